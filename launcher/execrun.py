"""One exec of a session driven to its end: its stdout and stderr as ordered chunks of
scrubbed UTF-8 text, its stdin fed, its output capped, its timeout, a kill from outside,
then one exit record with the denials of its span.

The pieces that touch no process are pure (`StreamText`: incremental UTF-8 decoding,
the byte cap and scrubbing that holds back a tail, so a secret split across two reads is
still replaced). `drive` is the thread shell around an `ExecProc` (any tier's): it only
moves bytes from the pipes to `emit` and watches the process, all in one thread (a
thread per stream cost two thread starts and their wake-ups on every exec).
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import selectors
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from .scrub import Scrubber, scrub_literals, scrub_names
from .supervise import feed

ExecEnd = Literal["exit", "timeout", "killed", "limit"]
READ_SIZE = 65536
POLL_S = 0.02  # how often the watch looks at the timeout and a kill between waits
DRAIN_S = 5.0  # a pipe still open this long after the command ended is not waited for


class _Stage:
    """One scrubbing pass over a stream (pure): `apply` is the pass, `pattern` finds what
    it replaces, `words` what a tail could grow into. A tail that could still become a
    match waits for more text; a match that reaches the cut moves the cut before it (its
    boundary check needs the character after it). Each piece is scrubbed with one
    character of context on both sides, as if the whole text were scrubbed at once."""

    def __init__(self, words: list[str], apply: Callable[[str], str], fold: bool) -> None:
        self.apply = apply
        self.fold = fold  # names match case-insensitively
        self.words = tuple({w.lower() if fold else w for w in words if w})
        self.hold = max((len(w) for w in self.words), default=0)
        self.pattern = (re.compile("|".join(re.escape(w) for w in sorted(
            self.words, key=len, reverse=True)), re.IGNORECASE if fold else 0)
            if self.words else None)
        self.pending = ""
        self.prev = ""  # the last character passed on

    def feed(self, text: str) -> str:
        self.pending += text
        return self._emit(self._cut())

    def end(self) -> str:
        return self._emit(len(self.pending))

    def _cut(self) -> int:
        text = self.pending
        cut = len(text) - self._open_tail(text)
        if self.pattern is not None:
            for m in self.pattern.finditer(text, max(0, cut - self.hold)):
                if m.start() >= cut:
                    break
                if m.end() >= cut:
                    return m.start()
        return cut

    def _open_tail(self, text: str) -> int:
        for k in range(min(len(text), self.hold), 0, -1):
            tail = text[-k:].lower() if self.fold else text[-k:]
            if any(w.startswith(tail) for w in self.words):
                return k
        return 0

    def _emit(self, cut: int) -> str:
        piece, self.pending = self.pending[:cut], self.pending[cut:]
        if not piece:
            return ""
        after = self.pending[:1]
        out = self.apply(self.prev + piece + after)
        if self.prev and out.startswith(self.prev):
            out = out[len(self.prev):]
        if after and out.endswith(after):
            out = out[:-len(after)]
        self.prev = piece[-1]
        return out


class StreamText:
    """One output stream's bytes -> scrubbed text, chunk by chunk (pure).

    Incremental UTF-8 decoding (invalid bytes become U+FFFD), the byte cap, then the two
    passes of `scrub.scrub` as two `_Stage`s: literals (host paths, addresses, environment
    values), then host names over the first pass's output. A secret split across two
    reads is still replaced; ordinary output passes at once.
    """

    def __init__(self, scrubber: Scrubber, cap: int) -> None:
        self.cap = cap
        self.kept = 0  # bytes taken, at most `cap`
        self.total = 0  # every byte the command wrote
        self.truncated = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._literals = _Stage([k for k, _ in scrubber.pairs],
                                lambda t: scrub_literals(t, scrubber), fold=False)
        self._names = _Stage(list(scrubber.hostnames),
                             lambda t: scrub_names(t, scrubber), fold=True)

    def feed(self, data: bytes) -> str:
        self.total += len(data)
        room = self.cap - self.kept
        if len(data) > room:
            self.truncated = True
            data = data[:max(room, 0)]
        self.kept += len(data)
        return self._names.feed(self._literals.feed(self._decoder.decode(data)))

    def end(self) -> str:
        lit = self._literals.feed(self._decoder.decode(b"", final=True))
        return self._names.feed(lit + self._literals.end()) + self._names.end()


@dataclass
class ExecLimits:
    cap: int  # bytes kept per stream
    timeout_s: float | None = None


@dataclass(eq=False)  # identity: the session's set of running execs holds them
class ExecControl:
    """What stops an exec from outside: a kill (DELETE, the session's end, a client that
    went away) and why."""

    stop: threading.Event = field(default_factory=threading.Event)
    reason: ExecEnd = "killed"

    def kill(self, reason: ExecEnd = "killed") -> None:
        if not self.stop.is_set():
            self.reason = reason
            self.stop.set()


class _Streams:
    """The exec's stdout and stderr read in the driving thread (one selector, no thread per
    stream): each read is scrubbed and emitted at once, in order per stream."""

    def __init__(self, proc: Any, texts: dict[str, StreamText],
                 emit: Callable[[dict[str, Any]], None]) -> None:
        self.texts, self.emit = texts, emit
        self.sel = selectors.DefaultSelector()
        for kind in texts:
            stream: IO[bytes] | None = getattr(proc, kind)
            if stream is not None:
                self.sel.register(stream.fileno(), selectors.EVENT_READ, (kind, stream))

    def open(self) -> bool:
        return bool(self.sel.get_map())

    def read(self, timeout: float) -> None:
        """What is readable within `timeout`; a stream at its end (or closed under us at a
        kill) emits its held-back tail and leaves the selector."""
        for key, _ in self.sel.select(timeout):
            kind, stream = key.data
            try:
                chunk = os.read(key.fd, READ_SIZE)
            except OSError:
                chunk = b""
            if chunk:
                if out := self.texts[kind].feed(chunk):
                    self.emit({"type": kind, "data": out})
                continue
            self._finish(key.fd, kind, stream)

    def close(self) -> None:
        """The streams still open (a process outside the exec holds a pipe): their tails."""
        for key in list(self.sel.get_map().values()):
            self._finish(key.fd, *key.data)
        self.sel.close()

    def _finish(self, fd: int, kind: str, stream: IO[bytes]) -> None:
        self.sel.unregister(fd)
        with contextlib.suppress(OSError):
            stream.close()
        if tail := self.texts[kind].end():
            self.emit({"type": kind, "data": tail})


def _stopped(proc: Any, control: ExecControl, deadline: float | None) -> ExecEnd | None:
    """How the exec ended, once it has (a kill or the timeout end it here); None while it
    runs."""
    if proc.poll() is not None:
        # a kill of the whole sandbox may end it before the watch saw the stop
        return control.reason if control.stop.is_set() else "exit"
    why: ExecEnd | None = None
    if control.stop.is_set():
        why = control.reason
    elif deadline is not None and time.monotonic() >= deadline:
        why = "timeout"
    if why is not None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(DRAIN_S)
    return why


def _run(proc: Any, streams: _Streams, limits: ExecLimits, control: ExecControl,
         t0: float) -> ExecEnd:
    """Read the streams and watch the exec until it has ended and its streams are closed
    (or `DRAIN_S` passed after its end)."""
    deadline = t0 + limits.timeout_s if limits.timeout_s else None
    ended_by: ExecEnd | None = None
    drained_at = 0.0
    while ended_by is None or streams.open():
        if ended_by is None and not streams.open():
            # both streams closed before the end: wait for the end itself
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(POLL_S)
        elif ended_by is None:
            streams.read(POLL_S)
        else:
            streams.read(max(0.0, drained_at - time.monotonic()))
            if time.monotonic() >= drained_at:
                break
        if ended_by is None and (ended_by := _stopped(proc, control, deadline)):
            drained_at = time.monotonic() + DRAIN_S
    streams.close()
    return ended_by


def drive(proc: Any, stdin: bytes | None, limits: ExecLimits, scrubber: Scrubber,
          control: ExecControl, emit: Callable[[dict[str, Any]], None],
          denials: Callable[[], list[dict[str, Any]]]) -> dict[str, Any]:
    """Run `proc` (an ExecProc) to its end; every chunk goes to `emit` as it is read, in
    order per stream; returns the exit record (also emitted last)."""
    t0 = time.monotonic()
    texts = {k: StreamText(scrubber, limits.cap) for k in ("stdout", "stderr")}
    if proc.stdin is not None:  # fed from a thread: a command that never reads
        threading.Thread(target=feed, args=(proc.stdin, stdin or b""), daemon=True).start()
    ended_by = _run(proc, _Streams(proc, texts, emit), limits, control, t0)
    rc = proc.poll()
    exit_code = None if rc is None else (128 - rc if rc < 0 else rc)
    record = {"type": "exit", "exit_code": exit_code, "ended_by": ended_by,
              "duration_s": round(time.monotonic() - t0, 6), "denials": denials(),
              "stdout_truncated": texts["stdout"].truncated,
              "stderr_truncated": texts["stderr"].truncated}
    emit(record)
    return record
