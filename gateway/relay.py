"""Byte relay between the sandbox and the checked upstream: splice where possible.

Hand-written because asyncio streams copy every chunk through Python objects; here each
direction moves data socket -> pipe -> socket with `os.splice` (zero-copy in the kernel)
driven by `loop.add_reader/add_writer`, falling back to `recv_into`/`send` on a reused
buffer where splice is unavailable. Pipes come from a shared pool: a pipe is held only
while a chunk is in flight, so 10,000 idle tunnels cost no pipe descriptors.

Half-close is propagated (EOF on one side -> shutdown(SHUT_WR) on the other); the
relay ends when both directions reached EOF or either side failed. `count_up` is asked
before uploaded bytes leave the pipe, so the per-task upload cap is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from collections.abc import Callable

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


def _wake(fut: asyncio.Future[None]) -> None:
    # the fd can fire again (or the waiter be cancelled) before remove_reader runs
    if not fut.done():
        fut.set_result(None)


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


async def wait_fd(
    loop: asyncio.AbstractEventLoop,
    fd: int,
    write: bool,
    deadline: float | None = None,
) -> None:
    """Wait until `fd` is readable (writable); TimeoutError at `deadline` (loop time).

    Not `asyncio.timeout`: that needs a current task, and the gateway's connections run
    their first step before they have one (see stockade.eager).
    """
    fut: asyncio.Future[None] = loop.create_future()
    add, remove = (
        (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    )
    add(fd, _wake, fut)
    timer = loop.call_at(deadline, _expire, fut) if deadline is not None else None
    try:
        await fut
    finally:
        remove(fd)
        if timer is not None:
            timer.cancel()


class Relay:
    """Moves bytes both ways between two connected, non-blocking sockets."""

    def __init__(
        self,
        client: socket.socket,
        upstream: socket.socket,
        *,
        count_up: Callable[[int], bool],
        pool: PipePool | None,
        on_activity: Callable[[], None],
        first: bytes = b"",
        first_sent: int = 0,
        up_limit: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.loop = loop  # the running loop, if the caller has it (else looked up in run)
        self.client = client
        self.upstream = upstream
        # already decided and counted; `first_sent` of it is sent, run() sends the rest
        self.first = first[first_sent:]
        self.count_up = count_up  # False: the upload budget is exhausted
        self.pool = pool  # None: no splice, use the copy loop
        self.on_activity = on_activity
        self.bytes_up = len(first)
        self.bytes_down = 0
        # at most this many bytes (with `first`) ever go upstream; the client's bytes
        # after them are never read (a plain-HTTP request's framed end, see tcp/start.py)
        self.up_left = None if up_limit is None else max(0, up_limit - len(first))

    async def run(self) -> None:
        """Return when both directions are done; raise UploadLimit / OSError on failure.

        Each direction is a callback state machine (`_Pump`) driven by reader/writer
        readiness, with no task of its own: bytes are moved from the very callback that
        reports them (no task wake-up, no per-chunk reader churn, and a tunnel's end costs
        no loop rounds of its own). Both start before the caller's first await, so the
        upstream's first bytes are relayed as soon as they arrive. The caller awaits one
        future: done when both directions reached EOF (or the upload its limit), failed
        with the first error of either, which stops the other.
        """
        loop = self.loop or asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        down = _Pump(self, loop, up=False, finished=finished)
        up = _Pump(self, loop, up=True, finished=finished, seed=self.first)
        self.first = b""
        down.other, up.other = up, down
        down.start()  # listening for the upstream's answer before the rest is sent
        up.start()
        try:
            await finished
        finally:
            down.close()
            up.close()

    def _account(self, n: int, up: bool) -> None:
        if up:
            self.bytes_up += n
        else:
            self.bytes_down += n
        self.on_activity()


class _Pump:
    """One direction (client -> upstream when `up`, else upstream -> client) as a
    callback state machine.

    Reading: a reader on the source stays registered while the destination takes the
    bytes; each readiness callback moves data until the source has none (EAGAIN), the
    destination would block (then: writer on the destination, source reader off, so a
    level-triggered reader never spins on unread data) or EOF (shutdown(SHUT_WR) on the
    destination, done). Splice mode holds a pipe only while a chunk is in flight.
    Upload only: `count_up` is asked before a chunk leaves (the cap is exact), and with
    `relay.up_left` the client is read in copy mode up to that many bytes, then no more
    (no half-close: some servers take it for an aborted request).
    """

    def __init__(
        self,
        relay: Relay,
        loop: asyncio.AbstractEventLoop,
        *,
        up: bool,
        finished: asyncio.Future[None],
        seed: bytes = b"",
    ) -> None:
        self.relay = relay
        self.loop = loop
        self.up = up
        self.finished = finished  # shared by both directions (see Relay.run)
        self.other: _Pump | None = None
        self.src, self.dst = (
            (relay.client, relay.upstream) if up else (relay.upstream, relay.client)
        )
        self.sfd = self.src.fileno()
        self.dfd = self.dst.fileno()
        self.done = False
        self.reading = False
        self.writing = False
        self.limited = up and relay.up_left is not None
        self.splice = relay.pool is not None and not self.limited
        self.pipe: tuple[int, int] | None = None  # splice: a chunk in flight
        self.left = 0  # bytes of that chunk not yet written
        self.buf: bytearray | None = None if self.splice else bytearray(CHUNK)
        # copy mode, and the first bytes (already counted): a chunk not yet fully sent
        self.pending: memoryview | None = memoryview(seed) if seed else None
        self.chunk = 0  # size of the chunk in flight (accounted once fully written)

    def start(self) -> None:
        if self.pending is not None:  # the first bytes' rest: send when writable
            self._watch(read=False, write=True)
        elif self.limited and self.relay.up_left is not None and self.relay.up_left <= 0:
            self.done = True  # the first bytes were all it may send: never read the client
        else:
            # nothing to move yet (the upstream has only just been sent the first bytes,
            # the client waits for the answer): listen instead of hearing EAGAIN
            self._watch(read=True, write=False)

    def close(self) -> None:
        """Stop (the tunnel is being torn down); releases a half-moved chunk's pipe."""
        self._watch(read=False, write=False)
        if self.pipe is not None:
            PipePool.discard(self.pipe)  # bytes may remain inside: never reuse
            self.pipe = None

    def _watch(self, *, read: bool, write: bool) -> None:
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
            self._watch(read=False, write=False)
            return
        try:
            if self.pending is not None and self.buf is None:  # the first bytes, splice mode
                state = self._send_pending()
                if state is None:
                    state = self._move_splice()
            elif self.splice:
                state = self._move_splice()
            else:
                state = self._move_copy()
        except Exception as e:  # a reset, the upload cap, or a bug: the tunnel ends
            self._fail(e)
            return
        if state in ("eof", "limit"):
            self._watch(read=False, write=False)
            if state == "eof":
                try:  # noqa: SIM105 - no context object: twice per connection
                    self.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            self.done = True
            if self.other is not None and self.other.done and not self.finished.done():
                self.finished.set_result(None)
        elif state == "read":
            self._watch(read=True, write=False)
        else:  # "write": the destination is not taking bytes
            self._watch(read=False, write=True)

    def _fail(self, exc: BaseException) -> None:
        self.close()
        if self.other is not None:
            self.other.close()
        if not self.finished.done():
            self.finished.set_exception(exc)

    def _send_pending(self) -> str | None:
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
            state = self._send_pending()
            if state is not None:
                return state
            if drained:
                return "read"


def splice_works() -> bool:
    """Probe once: some sandboxes (gVisor, seccomp) refuse splice on sockets."""
    if not HAVE_SPLICE:
        return False
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        a.sendall(b"x")
        b.setblocking(False)
        return os.splice(b.fileno(), w, 1) == 1
    except OSError:
        return False
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()
