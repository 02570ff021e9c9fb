"""`stockade events verify`: check the hash chains of event files (see chain.py).

The core (`Verifier`) is pure: lines in, findings out. Lines are grouped by
`stockade.chain.stream`; for each stream it reports the first gap (a sequence number
skipped), reorder or duplicate, edit (a `prev` that is not the digest of the stream's
previous line, or a line that is not JSON), bad checkpoint (signature, unknown key, or a
sequence/digest that is not the chain's) and, from the signed heads, truncation. The
shell (`run`) reads the files, oldest rotation first, and prints.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .chain import CHECKPOINT_ACTION, GENESIS, check_signature, digest
from .chainkey import HEADS_DIR, PUB_FILE, ChainError, key_id, load_public_key
from .writer import ROTATION_CHECK_S

_ROTATED = re.compile(r"(.+)\.(\d+)")


@dataclass
class Finding:
    where: str  # file:line, or the head file
    stream: str | None
    kind: str  # gap, reorder, edit, checkpoint, truncation; notes: start, torn, head, unsigned
    text: str

    def __str__(self) -> str:
        who = f" stream {self.stream}" if self.stream else ""
        return f"{self.where}:{who} {self.kind}: {self.text}"


@dataclass
class _Stream:
    seq: int
    digest: str
    where: str
    linked: bool
    lines: int = 1
    first_seq: int = 1
    signed_seq: int = 0  # the last sequence number a valid checkpoint covers
    checkpoints: dict[int, str] = field(default_factory=dict)  # seq -> digest, signed
    failed: bool = False  # its first finding is reported; the rest would only echo it
    gap: Finding | None = None  # a jump, held until the next line tells a gap from a swap
    late_start: Finding | None = None  # begins past seq 1 after the oldest file: see finish


def _parts(ev: Any) -> tuple[Any, Any, Any, Any]:
    """(chain, sequence, checkpoint, action) of a line in either shape it is written in:
    ECS (stockade.chain, event.sequence) or OCSF (unmapped.chain, metadata.sequence; ocsf.py)."""
    if not isinstance(ev, dict):
        return None, None, None, None
    if "class_uid" in ev:
        st, e = ev.get("unmapped"), ev.get("metadata")
        st = st if isinstance(st, dict) else {}
        inner = st.get("stockade")
        cp = inner.get("checkpoint") if isinstance(inner, dict) else None
        e = e if isinstance(e, dict) else {}
        return st.get("chain"), e.get("sequence"), cp, e.get("event_code")
    st, e = ev.get("stockade"), ev.get("event")
    st = st if isinstance(st, dict) else {}
    e = e if isinstance(e, dict) else {}
    return st.get("chain"), e.get("sequence"), st.get("checkpoint"), e.get("action")


def _chain_fields(ev: Any) -> tuple[str, int, str | None] | None:
    """(stream, sequence, prev) of a chained event, None when they are missing or malformed."""
    ch, seq, _, _ = _parts(ev)
    if not isinstance(ch, dict) or not isinstance(ch.get("stream"), str) or \
            not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        return None
    prev = ch.get("prev")
    return ch["stream"], seq, prev if isinstance(prev, str) else None


class Verifier:
    """Feed lines in file order (oldest file first), then `finish` with the heads."""

    def __init__(self, keys: dict[str, Ed25519PublicKey]) -> None:
        self.keys = keys
        self.streams: dict[str, _Stream] = {}
        self.findings: list[Finding] = []
        self.notes: list[Finding] = []
        self.lines = 0
        self.first_time: float | None = None  # @timestamp of the first line read

    def feed(self, where: str, raw: bytes, *, oldest: bool, last: bool = False) -> None:
        """One line as read (with its newline). `oldest`: the file is the oldest given of
        its name, where a stream may begin past seq 1 (its start was rotated away);
        `last`: the file's last line, which may be torn by a crash or a writer still busy."""
        if last and not raw.endswith(b"\n"):
            self.notes.append(Finding(where, None, "torn", "last line has no newline; not checked"))
            return
        if not raw.strip():
            return
        self.lines += 1
        try:
            ev = json.loads(raw)
        except ValueError:
            self.findings.append(Finding(where, None, "edit", "not a JSON line"))
            return
        if self.first_time is None:
            self.first_time = _epoch(ev)
        fields = _chain_fields(ev)
        if fields is None:
            self.findings.append(Finding(
                where, None, "edit", "no chain fields (inserted, or written without a chain)"))
            return
        s, seq, prev = fields
        st = self.streams.get(s)
        if st is None:
            self._start(where, s, seq, prev, oldest, raw)
            return
        if not st.failed:
            self._link(st, where, s, seq, prev)
        if not st.failed and st.gap is None:
            self._checkpoint(st, where, s, ev)
        st.seq, st.digest, st.where = max(st.seq, seq), digest(raw), where
        st.lines += 1

    def _start(self, where: str, s: str, seq: int, prev: str | None, oldest: bool,
               raw: bytes) -> None:
        st = _Stream(seq, digest(raw), where, prev is not None, first_seq=seq)
        self.streams[s] = st
        if prev is None:
            self.notes.append(Finding(where, s, "unsigned",
                                      "written with events.chain: false; only sequence checked"))
        if seq == 1 and prev not in (None, GENESIS):
            self._fail(st, Finding(where, s, "edit", "first line does not start the chain"))
        elif seq > 1 and oldest:
            self.notes.append(Finding(where, s, "start",
                                      f"starts at seq {seq} (earlier lines rotated away)"))
        elif seq > 1:
            st.late_start = Finding(where, s, "gap", f"starts at seq {seq}: 1..{seq - 1} "
                                    "missing (a deleted file?)")

    def _link(self, st: _Stream, where: str, s: str, seq: int, prev: str | None) -> None:
        if st.gap is not None:  # the line after a jump: a swap brings the skipped one back
            gap, st.gap = st.gap, None
            if seq < st.seq:
                self._fail(st, Finding(where, s, "reorder", f"seq {seq} after {st.seq}"))
            else:
                self._fail(st, gap)
            return
        if seq <= st.seq:
            kind = "reorder" if seq < st.seq else "duplicate"
            self._fail(st, Finding(where, s, kind, f"seq {seq} after {st.seq}"))
        elif seq > st.seq + 1:
            missing = f"{st.seq + 1}" if seq == st.seq + 2 else f"{st.seq + 1}..{seq - 1}"
            st.gap = Finding(where, s, "gap", f"seq {missing} missing (after {st.where})")
        elif st.linked and prev != st.digest:
            self._fail(st, Finding(where, s, "edit", f"seq {st.seq} at {st.where} was changed "
                                   "(its digest is not this line's prev)"))

    def _checkpoint(self, st: _Stream, where: str, s: str, ev: dict[str, Any]) -> None:
        """A checkpoint line must verify and cover the line before it in its stream."""
        _, _, cp, action = _parts(ev)
        if not isinstance(cp, dict):
            if action == CHECKPOINT_ACTION:
                self._fail(st, Finding(where, s, "checkpoint", "a checkpoint without its fields"))
            return
        bad = self._bad_checkpoint(cp)
        if bad is None and (cp.get("stream") != s or cp.get("seq") != st.seq
                            or cp.get("digest") != st.digest):
            bad = f"covers seq {cp.get('seq')} of {cp.get('stream')}, not this chain's seq {st.seq}"
        if bad is not None:
            self._fail(st, Finding(where, s, "checkpoint", bad))
            return
        st.signed_seq = st.seq
        st.checkpoints[st.seq] = st.digest

    def _bad_checkpoint(self, cp: dict[str, Any]) -> str | None:
        pub = self.keys.get(cp.get("key_id"))  # type: ignore[arg-type]
        if pub is None:
            return f"signed with unknown key {cp.get('key_id')!r} (wrong --key?)"
        if not isinstance(cp.get("seq"), int) or not check_signature(pub, cp):
            return "signature does not verify"
        return None

    def _fail(self, st: _Stream, finding: Finding) -> None:
        st.failed = True
        self.findings.append(finding)

    def finish(self, heads: dict[str, tuple[str, dict[str, Any]]]) -> None:
        """End of input: held gaps are gaps; each head (stream -> (its file, its content))
        must be signed and must not lie beyond its stream's last line."""
        for s, st in self.streams.items():
            if st.late_start is not None:
                self._late_start(st, heads.get(s, ("", {}))[1])
            if st.gap is not None and not st.failed:
                self._fail(st, st.gap)
            st.gap = None
        for s, (where, head) in sorted(heads.items()):
            self._head(s, where, head)

    def _late_start(self, st: _Stream, head: dict[str, Any]) -> None:
        """A quiet process's stream may have written nothing while the oldest file given
        was current: its start was rotated away, not deleted, when its head (whose
        checkpoint verifies) says it started before that file's first line, with a
        rotation check's lag to spare. Without such a head it is a gap."""
        assert st.late_start is not None
        started = head.get("started") if self._bad_checkpoint(head) is None else None
        if isinstance(started, int | float) and self.first_time is not None and \
                started < self.first_time + 2 * ROTATION_CHECK_S:
            self.notes.append(Finding(st.late_start.where, st.late_start.stream, "start",
                                      f"starts at seq {st.first_seq}, its process started "
                                      "before these files (earlier lines rotated away)"))
        else:
            self.findings.append(st.late_start)
            st.failed = True
        st.late_start = None

    def _head(self, s: str, where: str, head: dict[str, Any]) -> None:
        st = self.streams.get(s)
        if st is not None and st.failed:
            return
        bad = self._bad_checkpoint(head) if head.get("stream") == s else "names another stream"
        if bad is not None:
            self.findings.append(Finding(where, s, "checkpoint", f"head {bad}"))
        elif st is None:
            self.notes.append(Finding(where, s, "head", f"no lines of this stream in these files "
                                      f"(its head is at seq {head['seq']}: rotated away?)"))
        elif head["seq"] > st.seq:
            self._fail(st, Finding(where, s, "truncation", f"ends at seq {st.seq} ({st.where}),"
                                   f" its signed head is at seq {head['seq']}"))
        elif st.checkpoints.get(head["seq"], head.get("digest")) != head.get("digest"):
            self._fail(st, Finding(where, s, "checkpoint", "head does not match the chain"))

    def summary(self) -> dict[str, Any]:
        return {
            "ok": not self.findings, "lines": self.lines,
            "findings": [asdict(f) for f in self.findings],
            "notes": [asdict(f) for f in self.notes],
            "streams": {s: {"first_seq": st.first_seq, "last_seq": st.seq, "lines": st.lines,
                            "signed_seq": st.signed_seq, "intact": not st.failed}
                        for s, st in self.streams.items()},
        }


def _epoch(ev: Any) -> float | None:
    if isinstance(ev, dict) and "class_uid" in ev:  # OCSF: epoch milliseconds
        t = ev.get("time")
        return t / 1000 if isinstance(t, int) and not isinstance(t, bool) else None
    ts = ev.get("@timestamp") if isinstance(ev, dict) else None
    try:
        return datetime.fromisoformat(ts).timestamp() if isinstance(ts, str) else None
    except ValueError:
        return None


def order_files(paths: list[Path]) -> list[tuple[Path, bool]]:
    """Oldest first: `X.5 ... X.1, X` for each name X (others keep their order), each with
    whether it is the oldest file of its name."""
    base_rank: dict[str, int] = {}
    keyed = []
    for p in paths:
        m = _ROTATED.fullmatch(p.name)
        base, n = (m.group(1), int(m.group(2))) if m else (p.name, 0)
        rank = base_rank.setdefault(str(p.with_name(base)), len(base_rank))
        keyed.append(((rank, -n), p))
    keyed.sort(key=lambda kp: kp[0])
    seen: set[int] = set()
    out = []
    for (rank, _), p in keyed:
        out.append((p, rank not in seen))
        seen.add(rank)
    return out


def rotations(path: Path) -> list[Path]:
    """`path` and its rotated files that exist (any order: order_files sorts them)."""
    found = [p for p in path.parent.glob(f"{path.name}.*") if _ROTATED.fullmatch(p.name)
             and p.name[len(path.name) + 1:].isdigit()]
    return found + ([path] if path.exists() else [])


def verify_files(files: list[Path], keys: dict[str, Ed25519PublicKey],
                 heads_dir: Path | None) -> Verifier:
    """Read and check; OSError when a file cannot be read."""
    v = Verifier(keys)
    for path, oldest in order_files(files):
        with open(path, "rb") as fh:
            lines = fh.readlines()
        for n, raw in enumerate(lines, 1):
            v.feed(f"{path}:{n}", raw, oldest=oldest, last=n == len(lines))
    v.finish(read_heads(heads_dir) if heads_dir is not None else {})
    return v


def read_heads(heads_dir: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """stream -> (file, head) for every head file; a head that is not a JSON object is
    kept as {} so that it is reported rather than skipped."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    if not heads_dir.is_dir():
        return out
    for p in sorted(heads_dir.glob("*.json")):
        try:
            head = json.loads(p.read_bytes())
        except ValueError:
            head = {}
        out[p.stem] = (str(p), head if isinstance(head, dict) else {})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", metavar="FILE",
                   help="event files (default: the configured events file and its rotations)")
    p.add_argument("--key", action="append", metavar="PUB",
                   help="the chain's public key, PEM (repeatable; default: "
                   "<events.chain_dir>/signing.pub)")
    p.add_argument("--heads", metavar="DIR",
                   help="signed stream heads, for truncation (default: <events.chain_dir>/heads)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _inputs(args: argparse.Namespace) -> tuple[list[Path], list[str], Path | None]:
    """Files, key files and the heads directory: from the flags, else from stockade.yaml
    (through the loader the CLI hands every command). ChainError for a usage error."""
    files, keys = [Path(f) for f in args.files], list(args.key or [])
    heads = Path(args.heads) if args.heads else None
    loader = getattr(args, "config_loader", None)
    if (not files or not keys or heads is None) and loader is not None:
        files, keys, heads = _configured(loader(getattr(args, "config", None), "events verify"),
                                         files, keys, heads)
    if not files:
        raise ChainError("give the event files to check (FILE ...)")
    if not keys:
        raise ChainError("give the chain's public key (--key signing.pub)")
    return files, keys, heads


def _configured(cfg: Any, files: list[Path], keys: list[str],
                heads: Path | None) -> tuple[list[Path], list[str], Path | None]:
    """What the flags left out, from the loaded stockade.yaml."""
    files = files or rotations(cfg.events_file)
    if not files:
        raise ChainError(f"no events file at {cfg.events_file}")
    if cfg.events.chain_dir:
        chain_dir = Path(cfg.events.chain_dir)
        keys = keys or [str(chain_dir / PUB_FILE)]
        heads = heads if heads is not None else chain_dir / HEADS_DIR
    return files, keys, heads


def run(args: argparse.Namespace) -> int:
    """0: every chain intact; 1: findings; 2: a usage or read error."""
    try:
        files, key_files, heads = _inputs(args)
        pubs = [load_public_key(k) for k in key_files]
        v = verify_files(files, {key_id(k): k for k in pubs}, heads)
    except (ChainError, OSError) as e:
        print(f"stockade events verify: {e}", file=sys.stderr)
        return 2
    if heads is None or not heads.is_dir():
        v.notes.append(Finding(str(heads or "--heads"), None, "head",
                               "no heads directory: truncation not checked"))
    result = v.summary()
    if args.json:
        print(json.dumps(result))
        return 0 if result["ok"] else 1
    for f in [*v.findings, *v.notes]:
        print(f)
    broken = sum(1 for s in result["streams"].values() if not s["intact"])
    state = "intact" if result["ok"] else f"{len(v.findings)} finding(s)"
    print(f"{len(files)} file(s), {v.lines} line(s), {len(v.streams)} stream(s), "
          f"{broken} broken: {state}")
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stockade.events.verify",
                                description="Check the hash chains of Stockade event files.")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
