"""stockade.eager: a coroutine runs at once up to its first suspension, then as a task,
with a task's semantics for results, exceptions and cancellation (asyncio and uvloop)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from stockade.eager import start_eagerly

Runner = Callable[[Coroutine[Any, Any, Any]], Any]
RUNNERS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    return RUNNERS[request.param]


def test_first_step_runs_before_start_eagerly_returns(run: Runner) -> None:
    steps: list[str] = []

    async def work() -> str:
        steps.append("first")
        await asyncio.sleep(0)
        steps.append("second")
        return "result"

    async def main() -> None:
        fut = start_eagerly(work())
        assert steps == ["first"]  # ran synchronously, in this call
        assert await fut == "result"
        assert steps == ["first", "second"]

    run(main())


def test_a_coroutine_that_never_suspends_gives_a_done_future(run: Runner) -> None:
    async def quick() -> int:
        return 7

    async def fails() -> None:
        raise ValueError("boom")

    async def main() -> None:
        ok = start_eagerly(quick())
        assert ok.done() and ok.result() == 7
        bad = start_eagerly(fails())
        assert bad.done()
        with pytest.raises(ValueError, match="boom"):
            bad.result()

    run(main())


def test_future_results_and_exceptions_reach_the_coroutine(run: Runner) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        f1: asyncio.Future[int] = loop.create_future()
        f2: asyncio.Future[int] = loop.create_future()
        seen: list[object] = []

        async def work() -> str:
            seen.append(await f1)
            try:
                await f2
            except KeyError as e:
                seen.append(e.args[0])
            await asyncio.sleep(0.001)
            seen.append(asyncio.current_task() is not None)  # a real task from here on
            return "done"

        fut = start_eagerly(work())
        loop.call_soon(f1.set_result, 41)
        loop.call_later(0.005, f2.set_exception, KeyError("k"))
        assert await fut == "done"
        assert seen == [41, "k", True]

    run(main())


def test_cancelling_reaches_the_coroutine_and_its_cleanup_runs(run: Runner) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        waited: asyncio.Future[None] = loop.create_future()
        cleaned: list[str] = []

        async def work() -> None:
            try:
                await waited
            finally:
                cleaned.append("finally")

        fut = start_eagerly(work())
        await asyncio.sleep(0)
        fut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fut
        assert cleaned == ["finally"]
        assert waited.cancelled()  # what it waited on is cancelled too, as with a task

    run(main())


def test_a_coroutine_may_absorb_a_cancellation(run: Runner) -> None:
    async def main() -> None:
        async def work() -> str:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return "absorbed"
            return "slept"

        fut = start_eagerly(work())
        await asyncio.sleep(0)
        fut.cancel()
        assert await fut == "absorbed"

    run(main())


def test_socket_waits_work_after_an_eager_start(run: Runner) -> None:
    """The gateway's case: a loop socket operation is the first suspension."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        try:

            async def echo_once() -> bytes:
                data = await loop.sock_recv(a, 100)
                await loop.sock_sendall(a, data.upper())
                return data

            fut = start_eagerly(echo_once())
            assert not fut.done()
            await loop.sock_sendall(b, b"ping")
            assert await fut == b"ping"
            assert await loop.sock_recv(b, 100) == b"PING"
        finally:
            a.close()
            b.close()

    run(main())


def test_start_eagerly_on_a_loop_passed_in() -> None:
    """The caller's loop (the gateway keeps it) serves as the running one."""

    async def main() -> None:
        gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def coro() -> int:
            return await gate + 1

        fut = start_eagerly(coro(), asyncio.get_running_loop())
        assert not fut.done()
        gate.set_result(41)
        assert await fut == 42

    asyncio.run(main())
