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
    *,
    track: Callable[[asyncio.Future[None] | None], None] | None = None,
) -> None:
    """Wait until `fd` is readable (writable); TimeoutError at `deadline` (loop time).

    Not `asyncio.timeout`: that needs a current task, and the gateway's connections run
    their first step before they have one (see stockade.eager). `track` is told the
    waiter (and None after), so someone else can fail the wait (see `Relay.run`).
    """
    fut: asyncio.Future[None] = loop.create_future()
    add, remove = (
        (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    )
    add(fd, _wake, fut)
    timer = loop.call_at(deadline, _expire, fut) if deadline is not None else None
    if track is not None:
        track(fut)
    try:
        await fut
    finally:
        remove(fd)
        if timer is not None:
            timer.cancel()
        if track is not None:
            track(None)


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
    ) -> None:
        self.client = client
        self.upstream = upstream
        # already decided and counted; `first_sent` of it is sent, run() sends the rest
        self.first = first[first_sent:]
        self.count_up = count_up  # False: the upload budget is exhausted
        self.pool = pool  # None: no splice, use the copy loop
        self.on_activity = on_activity
        self.bytes_up = len(first)
        self.bytes_down = 0
        self._up_waiter: asyncio.Future[None] | None = None  # the upload side's wait
        self._failed: BaseException | None = None  # the download side's failure
        # at most this many bytes (with `first`) ever go upstream; the client's bytes
        # after them are never read (a plain-HTTP request's framed end, see server.py)
        self.up_left = None if up_limit is None else max(0, up_limit - len(first))

    async def run(self) -> None:
        """Return when both directions are done; raise UploadLimit / OSError on failure.

        The upload direction runs in the caller's coroutine; the download direction is
        driven by reader/writer callbacks (`_DownPump`), with no task of its own. It starts
        before the caller's first await, so the upstream's first bytes are relayed from
        the very readiness callback that reports them (no task wake-up, no per-chunk
        reader churn). A failure of the download side fails the upload side's current
        wait with the same exception, which tears the tunnel down. (Not by cancelling the
        caller's task: a connection's first step may run before it has one.)
        """
        loop = asyncio.get_running_loop()
        down = _DownPump(self, loop)

        def down_done(f: asyncio.Future[None]) -> None:
            if f.cancelled() or f.exception() is None:
                return
            self._failed = f.exception()
            waiter = self._up_waiter
            if waiter is not None and not waiter.done():
                waiter.set_exception(self._failed)  # type: ignore[arg-type]

        down.done.add_done_callback(down_done)
        down.start()  # listening for the upstream's answer before the rest can be sent
        try:
            if self.first:
                first, self.first = self.first, b""
                await self._send_all(loop, self.upstream, memoryview(first))
            await self._pump(self.client, self.upstream, True)
            await down.done
        finally:
            if not down.done.done():
                down.done.remove_done_callback(down_done)
            down.close()

    def _track(self, waiter: asyncio.Future[None] | None) -> None:
        self._up_waiter = waiter

    async def _wait_up(self, loop: asyncio.AbstractEventLoop, fd: int, write: bool) -> None:
        """The upload side's waits: failed at once by a download-side failure."""
        if self._failed is not None:
            raise self._failed
        await wait_fd(loop, fd, write, track=self._track)

    async def _send_all(
        self, loop: asyncio.AbstractEventLoop, dst: socket.socket, data: memoryview
    ) -> None:
        while data:
            try:
                data = data[dst.send(data) :]
            except (BlockingIOError, InterruptedError):
                await self._wait_up(loop, dst.fileno(), write=True)

    def _account(self, n: int, up: bool) -> None:
        if up:
            self.bytes_up += n
        else:
            self.bytes_down += n
        self.on_activity()

    async def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        loop = asyncio.get_running_loop()
        if up and self.up_left is not None:
            await self._pump_limited(loop, src, dst)
            return
        # the client has just sent its first message and usually waits for an answer:
        # wait for more instead of asking (an EAGAIN syscall per connection)
        await self._wait_up(loop, src.fileno(), write=False)
        if self.pool is not None:
            await self._pump_splice(loop, src, dst, up)
        else:
            await self._pump_copy(loop, src, dst, up)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    async def _pump_splice(
        self, loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket, up: bool
    ) -> None:
        assert self.pool is not None
        sfd, dfd = src.fileno(), dst.fileno()
        while True:
            pipe = self.pool.get()
            clean = False
            try:
                try:
                    n = os.splice(sfd, pipe[1], self.pool.size, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    clean = True
                    self.pool.put(pipe)
                    await self._wait_up(loop, sfd, write=False)
                    continue
                if n == 0:
                    clean = True
                    self.pool.put(pipe)
                    return  # EOF
                if up and not self.count_up(n):
                    raise UploadLimit
                left = n
                while left:
                    try:
                        left -= os.splice(pipe[0], dfd, left, flags=_SPLICE_FLAGS)
                    except BlockingIOError:
                        await self._wait_up(loop, dfd, write=True)
                self._account(n, up)
                clean = True
                self.pool.put(pipe)
            finally:
                if not clean:
                    self.pool.discard(pipe)  # bytes may remain inside: never reuse

    async def _pump_limited(
        self, loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket
    ) -> None:
        """The upload direction with `up_left`: copies that many bytes, then stops reading
        the client (no half-close: some servers take it for an aborted request). The
        client's EOF before that is passed on as usual."""
        assert self.up_left is not None
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while self.up_left > 0:
            try:
                n = src.recv_into(view[: min(CHUNK, self.up_left)])
            except BlockingIOError:
                await self._wait_up(loop, src.fileno(), write=False)
                continue
            except InterruptedError:
                continue
            if n == 0:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if not self.count_up(n):
                raise UploadLimit
            await self._send_all(loop, dst, view[:n])
            self.up_left -= n
            self._account(n, True)

    async def _pump_copy(
        self, loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket, up: bool
    ) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            try:
                n = src.recv_into(buf)
            except BlockingIOError:
                await self._wait_up(loop, src.fileno(), write=False)
                continue
            except InterruptedError:
                continue
            if n == 0:
                return
            if up and not self.count_up(n):
                raise UploadLimit
            await self._send_all(loop, dst, view[:n])
            self._account(n, up)


class _DownPump:
    """The download direction (upstream -> client) as a callback state machine.

    Reading: a reader on the upstream stays registered while the client takes the bytes;
    each readiness callback moves data until the upstream has none (EAGAIN), the client
    would block (then: writer on the client, upstream reader off, so a level-triggered
    reader never spins on unread data) or EOF (shutdown(SHUT_WR) on the client, done).
    Splice mode holds a pipe only while a chunk is in flight, as the coroutine pump does.
    """

    def __init__(self, relay: Relay, loop: asyncio.AbstractEventLoop) -> None:
        self.relay = relay
        self.loop = loop
        self.done: asyncio.Future[None] = loop.create_future()
        self.sfd = relay.upstream.fileno()
        self.dfd = relay.client.fileno()
        self.reading = False
        self.writing = False
        self.pipe: tuple[int, int] | None = None  # splice: a chunk in flight
        self.left = 0  # bytes of that chunk (or of `pending`) not yet written
        self.buf: bytearray | None = None if relay.pool is not None else bytearray(CHUNK)
        self.pending: memoryview | None = None  # copy mode: a chunk not yet fully sent
        self.chunk = 0  # size of the chunk in flight (accounted once fully written)

    def start(self) -> None:
        # nothing to move yet (the upstream has not been sent the first bytes, or has
        # only just been): listen instead of asking and hearing EAGAIN
        self._watch(read=True, write=False)

    def close(self) -> None:
        """Stop (the tunnel is being torn down); releases a half-moved chunk's pipe."""
        self._watch(read=False, write=False)
        if self.pipe is not None:
            PipePool.discard(self.pipe)  # bytes may remain inside: never reuse
            self.pipe = None
        if not self.done.done():
            self.done.cancel()

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
        if self.done.done():
            self._watch(read=False, write=False)
            return
        try:
            state = self._move_splice() if self.relay.pool is not None else self._move_copy()
        except Exception as e:  # a reset, or a bug: either way the tunnel ends (fail closed)
            self.close_with(e)
            return
        if state == "eof":
            self._watch(read=False, write=False)
            with contextlib.suppress(OSError):
                self.relay.client.shutdown(socket.SHUT_WR)
            self.done.set_result(None)
        elif state == "read":
            self._watch(read=True, write=False)
        else:  # "write": the client is not taking bytes
            self._watch(read=False, write=True)

    def close_with(self, exc: BaseException) -> None:
        self._watch(read=False, write=False)
        if self.pipe is not None:
            PipePool.discard(self.pipe)
            self.pipe = None
        if not self.done.done():
            self.done.set_exception(exc)

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
                self.pipe, self.left = pipe, n
                self.chunk = n
            while self.left:
                try:
                    self.left -= os.splice(self.pipe[0], self.dfd, self.left, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    return "write"
            pool.put(self.pipe)
            self.pipe = None
            self.relay._account(self.chunk, False)

    def _move_copy(self) -> str:
        assert self.buf is not None
        while True:
            if self.pending is None:
                try:
                    n = self.relay.upstream.recv_into(self.buf)
                except (BlockingIOError, InterruptedError):
                    return "read"
                if n == 0:
                    return "eof"
                self.pending = memoryview(self.buf)[:n]
                self.chunk = n
            while self.pending:
                try:
                    sent = self.relay.client.send(self.pending)
                except (BlockingIOError, InterruptedError):
                    return "write"
                self.pending = self.pending[sent:]
            self.pending = None
            self.relay._account(self.chunk, False)


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
