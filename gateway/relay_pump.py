"""The relay's moving parts: pooled pipes and one direction's byte pump.

See relay.py for why the relay is hand-written. A `Pump` moves one direction with
`os.splice` through a pooled pipe, or with `recv_into`/`send` on a reused buffer; while
a `RetryGate` watches a TLS tunnel's start (relay_gate.py) both pumps ask it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .relay import Relay
    from .relay_gate import RetryGate

CHUNK = 65536  # the copy loop's buffer
# Spliced chunks are as large as a pipe holds. A 1 MiB pipe (the kernel's default
# pipe-max-size) instead of the default 64 KiB moves a bulk download with a sixteenth of
# the splice calls and loop wake-ups: +10 points of direct-connection throughput in
# side-by-side runs. It costs no memory while idle: pages are only referenced while a
# chunk is in flight, and pipes are pooled (see PipePool).
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
HAVE_SPLICE = hasattr(os, "splice")


class UploadLimit(Exception):
    """The task's upload budget is exhausted."""


class PipePool:
    """Idle, empty pipes reused across connections (a pipe is dirty only mid-chunk)."""

    def __init__(self, keep: int = 64, size: int = PIPE_BYTES) -> None:
        self.keep = keep
        self.size = size  # what one splice asks for: the pipe's capacity
        self._grow = True  # False once the kernel refused a larger pipe
        self._free: list[tuple[int, int]] = []

    def get(self) -> tuple[int, int]:
        if self._free:
            return self._free.pop()
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._grow:
            try:
                self.size = fcntl.fcntl(w, _F_SETPIPE_SZ, self.size)
            except OSError:  # over pipe-max-size or the user's pipe quota: default pipes
                self._grow = False
                self.size = CHUNK
        return r, w

    def put(self, pipe: tuple[int, int]) -> None:
        if len(self._free) < self.keep:
            self._free.append(pipe)
        else:
            self.discard(pipe)

    @staticmethod
    def discard(pipe: tuple[int, int]) -> None:
        for fd in pipe:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        while self._free:
            self.discard(self._free.pop())


class Pump:
    """One direction (client -> upstream when `up`, else upstream -> client) as a
    callback state machine.

    Reading: a reader on the source stays registered while the destination takes the
    bytes; each readiness callback moves data until the source has none (EAGAIN), the
    destination would block (then: writer on the destination, source reader off, so a
    level-triggered reader never spins on unread data) or EOF (shutdown(SHUT_WR) on the
    destination, done). Splice mode holds a pipe only while a chunk is in flight.
    Upload only: `count_up` is asked before a chunk leaves (the cap is exact), and with
    `relay.up_left` the client is read in copy mode up to that many bytes, then no more
    (no half-close: some servers take it for an aborted request). With a `gate` (a TLS
    tunnel's start is watched) the gate is asked before each move until it lets go; the
    upload pump then registers nothing ("hold") while the gate keeps the client unread.
    """

    def __init__(
        self,
        relay: Relay,
        loop: asyncio.AbstractEventLoop,
        *,
        up: bool,
        finished: asyncio.Future[None],
        seed: bytes = b"",
        gate: RetryGate | None = None,
    ) -> None:
        self.relay = relay
        self.loop = loop
        self.up = up
        self.finished = finished  # shared by both directions (see Relay.run)
        self.other: Pump | None = None
        self.src, self.dst = (
            (relay.client, relay.upstream) if up else (relay.upstream, relay.client)
        )
        self.sfd = self.src.fileno()
        self.dfd = self.dst.fileno()
        self.done = False
        self.reading = False
        self.writing = False
        self.gate = gate  # None once the gate let this direction go (or never watched)
        self.limited = up and relay.up_left is not None
        self.splice = relay.pool is not None and not self.limited
        self.pipe: tuple[int, int] | None = None  # splice: a chunk in flight
        self.left = 0  # bytes of that chunk not yet written
        self.buf: bytearray | None = None if self.splice else bytearray(CHUNK)
        # the first bytes (already counted), or a chunk read in copy mode: not yet sent
        self.pending: memoryview | None = memoryview(seed) if seed else None
        self.chunk = 0  # size of the chunk in flight (accounted once fully written)

    def start(self) -> None:
        if self.pending is not None:  # the first bytes' rest: send when writable
            self.watch(read=False, write=True)
        elif self.limited and self.relay.up_left is not None and self.relay.up_left <= 0:
            self.done = True  # the first bytes were all it may send: never read the client
        elif self.gate is not None and self.up and self.gate.holding:
            pass  # the client is not read until the gate opens (it wakes this pump)
        else:
            # nothing to move yet (the upstream has only just been sent the first bytes,
            # the client waits for the answer): listen instead of hearing EAGAIN
            self.watch(read=True, write=False)

    def close(self) -> None:
        """Stop (the tunnel is being torn down); releases a half-moved chunk's pipe."""
        self.watch(read=False, write=False)
        if self.pipe is not None:
            PipePool.discard(self.pipe)  # bytes may remain inside: never reuse
            self.pipe = None

    def watch(self, *, read: bool, write: bool) -> None:
        if read != self.reading:
            if read:
                self.loop.add_reader(self.sfd, self._run)
            else:
                self.loop.remove_reader(self.sfd)
            self.reading = read
        if write != self.writing:
            if write:
                self.loop.add_writer(self.dfd, self._run)
            else:
                self.loop.remove_writer(self.dfd)
            self.writing = write

    def _run(self) -> None:
        if self.finished.done():
            self.watch(read=False, write=False)
            return
        try:
            state = self.send_pending() if self.pending is not None else None
            if state is None and self.gate is not None:
                state = self.gate.step(self)  # None: the gate lets this move go on
            if state is None:
                state = self._move_splice() if self.splice else self._move_copy()
        except Exception as e:  # a reset, the upload cap, a refusal, or a bug: it ends
            self._fail(e)
            return
        if state in ("eof", "limit"):
            self._end(state == "eof")
        elif state == "read":
            self.watch(read=True, write=False)
        elif state == "write":  # the destination is not taking bytes
            self.watch(read=False, write=True)
        else:  # "hold": the gate keeps the client unread; it wakes this pump
            self.watch(read=False, write=False)

    def _end(self, eof: bool) -> None:
        """This direction is done (at the source's EOF: the half-close passed on)."""
        self.watch(read=False, write=False)
        if eof:
            try:  # noqa: SIM105 - no context object: twice per connection
                self.dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self.done = True
        if self.other is not None and self.other.done and not self.finished.done():
            self.finished.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self.close()
        if self.other is not None:
            self.other.close()
        if not self.finished.done():
            self.finished.set_exception(exc)

    def send_pending(self) -> str | None:
        """Send what is left of `pending`; "write" if the destination is full."""
        while self.pending:
            try:
                sent = self.dst.send(self.pending)
            except (BlockingIOError, InterruptedError):
                return "write"
            self.pending = self.pending[sent:]
        self.pending = None
        if self.chunk:
            self.relay._account(self.chunk, self.up)
            self.chunk = 0
        return None
    def _move_splice(self) -> str:
        pool = self.relay.pool
        assert pool is not None
        while True:
            if self.pipe is None:
                pipe = pool.get()
                try:
                    n = os.splice(self.sfd, pipe[1], pool.size, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    pool.put(pipe)
                    return "read"
                except BaseException:
                    pool.put(pipe)  # nothing entered the pipe
                    raise
                if n == 0:
                    pool.put(pipe)
                    return "eof"
                if self.up and not self.relay.count_up(n):
                    PipePool.discard(pipe)  # the bytes inside never leave
                    raise UploadLimit
                self.pipe, self.left = pipe, n
                self.chunk = n
            while self.left:
                try:
                    self.left -= os.splice(self.pipe[0], self.dfd, self.left, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    return "write"
            pool.put(self.pipe)
            self.pipe = None
            self.relay._account(self.chunk, self.up)
            if self.chunk < pool.size:
                # a short read drained the socket: another splice would only hear
                # EAGAIN (a syscall per readiness); the level-triggered reader calls
                # again if more came meanwhile
                return "read"

    def _move_copy(self) -> str:
        assert self.buf is not None
        relay = self.relay
        while True:
            if self.pending is None:
                want = CHUNK
                if self.limited:
                    assert relay.up_left is not None
                    if relay.up_left <= 0:
                        return "limit"
                    want = min(CHUNK, relay.up_left)
                try:
                    n = self.src.recv_into(self.buf, want)
                except (BlockingIOError, InterruptedError):
                    return "read"
                if n == 0:
                    return "eof"
                if self.up and not relay.count_up(n):
                    raise UploadLimit
                if self.limited:
                    relay.up_left -= n  # type: ignore[operator]
                self.pending = memoryview(self.buf)[:n]
                self.chunk = n
                drained = n < want  # as in _move_splice: no recv just to hear EAGAIN
            else:
                drained = False
            state = self.send_pending()
            if state is not None:
                return state
            if drained:
                return "read"

