"""Start a coroutine at once, in the caller's stack, and continue it as a task.

Why: the gateway accepts connections from a reader callback. With `ensure_future` a new
connection's coroutine only starts after every callback already queued in that loop
iteration, typically the previous connection's teardown (about 0.1 ms on our hosts), so
the CONNECT's `200` or the first decision waits behind it. Started eagerly, the head is
read, decided and answered inside the accept callback, and the rest of the iteration runs
while the client's next bytes are on their way.

Python 3.12 has this built in (`asyncio.Task(..., eager_start=True)`) and it is used
there. On 3.11 the first step is driven by hand and `_continue` plays the part of the
task's step function. One difference remains on 3.11: code before the coroutine's
first suspension runs outside any task, so it must not need `asyncio.current_task()`
(hence not `asyncio.timeout()`); the gateway's path uses deadline-based waits instead.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

NATIVE = sys.version_info >= (3, 12)


def start_eagerly(
    coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop | None = None
) -> asyncio.Future[T]:
    """Run `coro` until it first suspends; return a future of its result.

    A coroutine that finishes without suspending gets an already-done future (no task).
    `loop`: the running loop, when the caller has it (on 3.11 asking for it is a
    getpid(2) each time: CPython checks the loop was not inherited over a fork).
    """
    loop = loop or asyncio.get_running_loop()
    if NATIVE:
        return asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg]
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        done: asyncio.Future[T] = loop.create_future()
        done.set_result(stop.value)
        return done
    except asyncio.CancelledError:
        cancelled: asyncio.Future[T] = loop.create_future()
        cancelled.cancel()
        return cancelled
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        failed: asyncio.Future[T] = loop.create_future()
        failed.set_exception(exc)
        return failed
    return loop.create_task(_continue(coro, yielded))


async def _continue(coro: Coroutine[Any, Any, T], yielded: Any) -> T:
    """Drive `coro` on from a suspension point, as `asyncio.Task` would have."""
    while True:
        thrown: BaseException | None = None
        try:
            if yielded is None:  # a bare `yield` (asyncio.sleep(0)): one loop round
                await asyncio.sleep(0)
            elif asyncio.isfuture(yielded):
                # the coroutine's own await marked it as blocking; a task clears the mark
                # before waiting (and a C future refuses to be awaited while it is set)
                yielded._asyncio_future_blocking = False
                await yielded
            else:
                thrown = RuntimeError(f"coroutine yielded a non-future: {yielded!r}")
        except asyncio.CancelledError as exc:
            # our task was cancelled (its wait on `yielded` was cancelled with it):
            # hand the cancellation to the coroutine, as a task throws it in
            if asyncio.isfuture(yielded) and not yielded.done():
                yielded.cancel()
            thrown = exc
        except Exception:  # noqa: S110 - the coroutine reads the future's outcome itself
            pass
        try:
            yielded = coro.throw(thrown) if thrown is not None else coro.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
