"""The tamper-evident chain of one event stream (one EventWriter, one process).

Each line a stream writes carries `event.sequence` (1, 2, ...), `event.id`
(`<stream>-<seq>`: stable across a shipper's retries, so copies can be dropped) and
`stockade.chain = {stream, prev}`, `prev` being the SHA-256 of the stream's previous line
as written (without its newline). Every `checkpoint_every` lines or `checkpoint_s`
seconds, and at close, the writer adds a `chain_checkpoint` event whose Ed25519 signature
covers the stream, the last sequence number and its digest; the same checkpoint goes to
`<chain_dir>/heads/<stream>.json`, which is how `stockade events verify` (verify.py)
notices a file cut short. The writer's lock serialises every call here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .build import make_event
from .chainkey import HEADS_DIR, key_id

Event = dict[str, Any]
GENESIS = "0" * 64  # `prev` of a stream's first line
CHECKPOINT_ACTION = "chain_checkpoint"
log = logging.getLogger("stockade.events")


def digest(line: bytes) -> str:
    """The digest the next line of the stream carries as `prev`."""
    return hashlib.sha256(line[:-1] if line.endswith(b"\n") else line).hexdigest()


def sig_payload(stream: str, seq: int, dig: str) -> bytes:
    # a fixed, versioned text: a signature made for anything else never verifies here
    return f"stockade-chain-v1\n{stream}\n{seq}\n{dig}\n".encode()


def check_signature(pub: Ed25519PublicKey, cp: dict[str, Any]) -> bool:
    try:
        pub.verify(base64.b64decode(cp["sig"], validate=True),
                   sig_payload(cp["stream"], cp["seq"], cp["digest"]))
    except (InvalidSignature, ValueError, TypeError, KeyError):
        return False
    return True


class ChainSigner:
    """Numbers, links and signs one stream's lines. Without a key (no chain_dir) there are
    no checkpoints; with `link=False` (events.chain: false) only id and sequence are set."""

    def __init__(self, key: Ed25519PrivateKey | None = None, chain_dir: str | Path | None = None,
                 *, link: bool = True, every: int = 1000, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = os.urandom(8).hex()
        self.key = key if link else None
        self.key_id = key_id(key.public_key()) if key is not None else ""
        self.heads = Path(chain_dir) / HEADS_DIR if chain_dir is not None else None
        self.link, self.every, self.interval_s, self.clock = link, every, interval_s, clock
        self.seq, self.prev = 0, GENESIS
        self.component = "stack"  # a checkpoint's component: that of the stream's last line
        self._since = 0  # lines since the last checkpoint
        self._last = clock()
        self._pending: dict[str, Any] | None = None  # the head, once its checkpoint is on disk
        self._stamped_checkpoint = False  # the line stamped last is that checkpoint
        self._started = time.time()

    def stamp(self, ev: Event, encode: Callable[[Event], bytes]) -> bytes:
        """`ev` with the next id, sequence and link, encoded. The `event` and `stockade`
        objects are replaced by stamped copies: a caller's nested dicts stay untouched."""
        n = self.seq + 1
        ev["event"] = {**ev.get("event", {}), "id": f"{self.stream}-{n}", "sequence": n}
        st = ev.get("stockade")
        st = dict(st) if isinstance(st, dict) else {}
        if isinstance(st.get("component"), str):
            self.component = st["component"]
        st["chain"] = {"stream": self.stream, "prev": self.prev} if self.link else \
            {"stream": self.stream}
        ev["stockade"] = st
        cp = st.get("checkpoint")
        self._stamped_checkpoint = cp is not None and cp == self._pending
        return encode(ev)

    def advance(self, line: bytes) -> None:
        """The stamped line is in the file: the next one follows it."""
        self.seq += 1
        if self.link:
            self.prev = digest(line)
        if self._stamped_checkpoint and self._pending is not None:
            self._write_head(self._pending)
            self._pending = None
            self._since = 0
            self._last = self.clock()
        else:
            self._since += 1

    def due(self, now: float | None = None) -> bool:
        """A checkpoint should follow: lines since the last one, and `every` of them or
        `interval_s` gone by (`now` on this signer's clock, monotonic by default)."""
        if self.key is None or self._since == 0:
            return False
        t = self.clock() if now is None else now
        return self._since >= self.every or t - self._last >= self.interval_s

    def checkpoint_event(self) -> Event:
        """The signed `chain_checkpoint` event over the stream's last line (write it with
        stamp/advance: the checkpoint is itself chained)."""
        assert self.key is not None
        cp = {"stream": self.stream, "seq": self.seq, "digest": self.prev, "key_id": self.key_id,
              "sig": base64.b64encode(self.key.sign(
                  sig_payload(self.stream, self.seq, self.prev))).decode()}
        self._pending = cp
        return make_event(component=self.component,  # type: ignore[arg-type]
                          action=CHECKPOINT_ACTION, extra={"checkpoint": cp},
                          message=f"chain checkpoint: stream {self.stream} seq {self.seq}")

    def _write_head(self, cp: dict[str, Any]) -> None:
        if self.heads is None:
            return
        # pid, program and start time are for people reading the directory
        head = {**cp, "pid": os.getpid(), "argv0": sys.argv[0] if sys.argv else "",
                "started": self._started}
        path = self.heads / f"{self.stream}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(json.dumps(head) + "\n")
            os.replace(tmp, path)
        except OSError as e:  # the line is written; only truncation checks lose this head
            log.warning("events: cannot write the chain head %s: %s", path, e)
