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
import os
import socket
from collections.abc import Callable

CHUNK = 65536
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
HAVE_SPLICE = hasattr(os, "splice")


class UploadLimit(Exception):
    """The task's upload budget is exhausted."""


class PipePool:
    """Idle, empty pipes reused across connections (a pipe is dirty only mid-chunk)."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._free: list[tuple[int, int]] = []

    def get(self) -> tuple[int, int]:
        if self._free:
            return self._free.pop()
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
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


async def _wait(loop: asyncio.AbstractEventLoop, fd: int, write: bool) -> None:
    fut = loop.create_future()
    add, remove = (
        (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    )
    add(fd, _wake, fut)
    try:
        await fut
    finally:
        remove(fd)


wait_fd = _wait  # for the gateway's own non-blocking connect


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
    ) -> None:
        self.client = client
        self.upstream = upstream
        self.count_up = count_up  # False: the upload budget is exhausted
        self.pool = pool  # None: no splice, use the copy loop
        self.on_activity = on_activity
        self.bytes_up = 0
        self.bytes_down = 0

    async def run(self) -> None:
        """Return when both directions are done; raise UploadLimit / OSError on failure.

        The upload direction runs in the caller's task and only the download direction
        gets a task of its own (one task per tunnel instead of two); a failure of the
        download side cancels the caller, which then tears the tunnel down.
        """
        me = asyncio.current_task()
        down = asyncio.ensure_future(self._pump(self.upstream, self.client, False))
        failed: list[BaseException] = []

        def down_done(t: asyncio.Future[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                failed.append(t.exception())  # type: ignore[arg-type]
                if me is not None:
                    me.cancel()

        down.add_done_callback(down_done)
        try:
            await self._pump(self.client, self.upstream, True)
            await down
        except asyncio.CancelledError:
            if failed:
                if me is not None:
                    me.uncancel()  # the cancel was ours, not the caller's
                raise failed[0] from None  # the download side failed: report that instead
            raise
        finally:
            if not down.done():
                down.remove_done_callback(down_done)
                down.cancel()
                with contextlib.suppress(BaseException):
                    await down

    def _account(self, n: int, up: bool) -> None:
        if up:
            self.bytes_up += n
        else:
            self.bytes_down += n
        self.on_activity()

    async def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        loop = asyncio.get_running_loop()
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
                    n = os.splice(sfd, pipe[1], CHUNK, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    clean = True
                    self.pool.put(pipe)
                    await _wait(loop, sfd, write=False)
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
                        await _wait(loop, dfd, write=True)
                self._account(n, up)
                clean = True
                self.pool.put(pipe)
            finally:
                if not clean:
                    self.pool.discard(pipe)  # bytes may remain inside: never reuse

    async def _pump_copy(
        self, loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket, up: bool
    ) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            try:
                n = src.recv_into(buf)
            except BlockingIOError:
                await _wait(loop, src.fileno(), write=False)
                continue
            except InterruptedError:
                continue
            if n == 0:
                return
            if up and not self.count_up(n):
                raise UploadLimit
            await loop.sock_sendall(dst, view[:n])
            self._account(n, up)


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
