"""JSON-lines event sink: one line per event, flushed per event, size-based rotation.

Nothing is dropped silently: an event that cannot be written (disk full, permissions,
an unserialisable value) increments `dropped`, which metrics export.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

Event = dict[str, Any]

# orjson writes key order, non-ASCII text (as UTF-8), ints and strings as json.dumps(...,
# separators=(",", ":"), ensure_ascii=False) does, about ten times faster (the events are
# on the gateway's per-connection and the broker's per-call path). Floats parse to the
# same number, but below 1e-4 are spelled without an exponent (0.00001, not 1e-05); NaN
# and infinities, which json.dumps wrote as non-JSON tokens, become null. Dataclasses and
# datetimes, which orjson would serialise itself, go to the stdlib fallback below, which
# refuses them as before (counted in `dropped`).
_ORJSON_OPTS = (
    orjson.OPT_APPEND_NEWLINE | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
)


def encode_line(event: Event) -> bytes:
    """One event as one JSON line (UTF-8, compact, newline-terminated).

    Raises TypeError or ValueError when the event cannot be written as JSON.
    """
    try:
        return orjson.dumps(event, option=_ORJSON_OPTS)
    except TypeError:
        # what orjson refuses but json.dumps wrote (non-str keys, ints beyond 64 bits,
        # float subclasses) keeps its old form; the rest fails here as it did before
        line = json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n"
        return line.encode("utf-8")

ROTATION_CHECK_S = 0.5  # how often a writer looks for a rotation done by another process


class EventWriter:
    # event -> one JSON line (bytes); a class attribute so bench/events_bench.py can time
    # this same write path with the encoder it replaced
    encode: Callable[[Event], bytes] = staticmethod(encode_line)

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        max_bytes: int = 50 * 2**20,
        backups: int = 5,
        stdout: bool = False,
        keep_recent: int = 0,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.max_bytes = max_bytes
        self.backups = backups
        self.stdout = stdout
        self.written = 0
        self.dropped = 0
        self.recent: deque[Event] = deque(maxlen=keep_recent)  # 0 keeps nothing
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._checked = 0.0
        self._ino = 0
        self._size = 0  # current file size, as seen at the last write (several writers share it)
        self._subscribers: list[Callable[[Event], None]] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def subscribe(self, fn: Callable[[Event], None]) -> None:
        """Call `fn` with every event written (metrics, tests, live views)."""
        self._subscribers.append(fn)

    def _open(self) -> int:
        """The open descriptor, reopened when another process (gateway, broker) rotated the
        file away; that is checked at most every ROTATION_CHECK_S, and events written in
        between land in the rotated file, not nowhere."""
        assert self.path is not None
        now = time.monotonic()
        if self._fd is not None:
            if now - self._checked < ROTATION_CHECK_S:
                return self._fd
            self._checked = now
            try:
                st = os.stat(self.path)
                if st.st_ino == self._ino:
                    self._size = st.st_size
                    return self._fd
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        st = os.fstat(self._fd)
        self._ino = st.st_ino
        self._size = st.st_size
        self._checked = now
        return self._fd

    def _rotate(self) -> None:
        assert self.path is not None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.backups > 0:
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)

    def write(self, event: Event) -> bool:
        try:
            data = self.encode(event)
        except (TypeError, ValueError):  # ValueError includes a lone surrogate's encode error
            self.dropped += 1
            return False
        ok = True
        with self._lock:
            if self.path is not None:
                try:
                    fd = self._open()
                    if self._size and self._size + len(data) > self.max_bytes:
                        self._rotate()
                        fd = self._open()
                    # one write(2) per line in O_APPEND mode: lines of several writers
                    # never interleave, and nothing waits in a user-space buffer
                    os.write(fd, data)
                    self._size += len(data)
                except OSError:
                    self.dropped += 1
                    ok = False
                    if self._fd is not None:
                        os.close(self._fd)
                    self._fd = None
            if self.stdout:
                try:
                    sys.stdout.write(data.decode("utf-8"))
                    sys.stdout.flush()
                except (OSError, ValueError):
                    self.dropped += 1
                    ok = False
            if ok:
                self.written += 1
            if self.recent.maxlen:
                self.recent.append(event)
        for fn in self._subscribers:
            try:
                fn(event)
            except Exception:  # a broken subscriber must not lose the event for others
                self.dropped += 1
        return ok

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """Read a JSON-lines event file (tests, `stockade events`); skips torn last lines."""
    out: list[Event] = []
    p = Path(path)
    if not p.exists():
        return out
    with open(p, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
