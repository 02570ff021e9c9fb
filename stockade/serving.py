"""Run one long-lived service (gateway, broker, launcher service) until SIGTERM/SIGINT.

Shared so every service handles signals the same way: handlers are installed before
start-up (a SIGTERM during start still ends in a clean stop), SIGHUP reloads the rules,
invalid rules or an unusable listen address at start exit 2 with a one-line reason.
Which exceptions mean "invalid rules" the caller says (`invalid_rules`): the rule model
sits above this module.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from stockade.events.chainkey import ChainError
from stockade.readiness import say_ready, take_ready_fd

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, uvloop: bool = True) -> T:
    """Run `main` on a fresh event loop: uvloop's when wanted and installed (its C loop
    costs a proxying service markedly less CPU per connection), else asyncio's."""
    with asyncio.Runner(loop_factory=_uvloop_factory() if uvloop else None) as runner:
        return runner.run(main)


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None  # an optional speed-up: asyncio's loop serves the same
    return uvloop.new_event_loop


async def serve_until_signalled(
    name: str,
    *,
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    reload: Callable[[], Any],
    banner: Callable[[], str],
    start_errors: tuple[type[BaseException], ...] = (OSError,),
    invalid_rules: tuple[type[BaseException], ...] = (),
) -> int:
    ready_fd = take_ready_fd()  # first: nothing this service starts may inherit it
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    pending: set[asyncio.Future[Any]] = set()  # a reference until each reload is done

    def hup() -> None:
        result = reload()
        if inspect.isawaitable(result):
            fut = asyncio.ensure_future(result)
            pending.add(fut)
            fut.add_done_callback(pending.discard)

    loop.add_signal_handler(signal.SIGHUP, hup)
    try:
        try:
            await start()
        except invalid_rules as e:
            print(f"stockade {name}: invalid rules:\n{e}", file=sys.stderr)
            return 2
        except (*start_errors, ChainError) as e:  # an unusable event-chain key: every service
            print(f"stockade {name}: cannot start: {e}", file=sys.stderr)
            return 2
        print(f"stockade {name}: {banner()}", file=sys.stderr, flush=True)
        say_ready(ready_fd)  # the stack that started it waits on this, not on polls
        await stopping.wait()
        return 0
    finally:
        await stop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
