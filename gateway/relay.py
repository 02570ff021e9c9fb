"""Byte relay between the sandbox and the checked upstream: splice where possible.

Hand-written because asyncio streams copy every chunk through Python objects; here each
direction moves data socket -> pipe -> socket with `os.splice` (zero-copy in the kernel)
driven by `loop.add_reader/add_writer`, falling back to `recv_into`/`send` on a reused
buffer where splice is unavailable. Pipes come from a shared pool: a pipe is held only
while a chunk is in flight, so 10,000 idle tunnels cost no pipe descriptors.

Half-close is propagated (EOF on one side -> shutdown(SHUT_WR) on the other); the
relay ends when both directions reached EOF or either side failed. `count_up` is asked
before uploaded bytes leave the pipe, so the per-task upload cap is exact. An
uninspected TLS tunnel's start is watched for a HelloRetryRequest (`RetryGate`).

The pumps and the pipe pool live in relay_pump.py, the gate in relay_gate.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

from .relay_gate import HelloRetryRefused, RetryGate
from .relay_pump import CHUNK, HAVE_SPLICE, PIPE_BYTES, PipePool, Pump, UploadLimit

__all__ = [
    "CHUNK", "PIPE_BYTES", "HelloRetryRefused", "PipePool", "Relay", "RetryGate",
    "UploadLimit", "splice_works", "wait_fd",
]


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
        gate: RetryGate | None = None,
    ) -> None:
        self.loop = loop  # the running loop, if the caller has it (else looked up in run)
        self.client = client
        self.upstream = upstream
        # already decided and counted; `first_sent` of it is sent, run() sends the rest
        self.first = first[first_sent:]
        self.count_up = count_up  # False: the upload budget is exhausted
        self.pool = pool  # None: no splice, use the copy loop
        self.on_activity = on_activity
        # a watched TLS tunnel: `first` is the first ClientHello's records; the gate holds
        # the client's bytes after them (counted with `first`) until the server answered
        self.gate = gate
        self.bytes_up = len(first) + (gate.early if gate is not None else 0)
        self.bytes_down = 0
        # at most this many bytes (with `first`) ever go upstream; the client's bytes
        # after them are never read (a plain-HTTP request's framed end, see tcp/start.py)
        self.up_left = None if up_limit is None else max(0, up_limit - len(first))

    async def run(self) -> None:
        """Return when both directions are done; raise UploadLimit, HelloRetryRefused (the
        gate refused what the client sent after a retry) or OSError on failure.

        Each direction is a callback state machine (`relay_pump.Pump`) driven by reader/writer
        readiness, with no task of its own: bytes are moved from the very callback that
        reports them (no task wake-up, no per-chunk reader churn, and a tunnel's end costs
        no loop rounds of its own). Both start before the caller's first await, so the
        upstream's first bytes are relayed as soon as they arrive. The caller awaits one
        future: done when both directions reached EOF (or the upload its limit), failed
        with the first error of either, which stops the other.
        """
        loop = self.loop or asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        gate = self.gate
        down = Pump(self, loop, up=False, finished=finished, gate=gate)
        up = Pump(self, loop, up=True, finished=finished, seed=self.first, gate=gate)
        self.first = b""
        down.other, up.other = up, down
        if gate is not None:
            gate.up = up  # woken by the gate once the server's first message is judged
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
