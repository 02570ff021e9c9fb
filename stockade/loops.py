"""Background loops that survive their errors.

A periodic job (task expiry, idle timeouts, rule polling, orphan reconciliation) whose
step raised used to end its loop for good: on a full state disk the gateway's expiry
loop died at the first failed save, and rule polling and idle timeouts stopped with it.
`every()` runs the step again after each error and logs it; `ErrorLog` (pure, takes
`now`) keeps a failure that repeats every 0.25 s from flooding the log: the first error,
then one line per `repeat_s` with the count, and one line when the step works again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ErrorLog:
    """When a failing periodic step is worth a log line (pure)."""

    repeat_s: float = 60.0
    failing_since: float | None = None
    last_logged: float = 0.0
    failures: int = 0  # since the last logged line

    def failed(self, now: float) -> tuple[str, int] | None:
        """A step failed at `now`: ("first", 1), ("again", failures since the last line)
        when it is worth a line, else None."""
        if self.failing_since is None:
            self.failing_since = self.last_logged = now
            self.failures = 0
            return ("first", 1)
        self.failures += 1
        if now - self.last_logged >= self.repeat_s:
            n, self.failures = self.failures, 0
            self.last_logged = now
            return ("again", n)
        return None

    def succeeded(self) -> bool:
        """A step worked: True when it had been failing (worth saying so)."""
        was = self.failing_since is not None
        self.failing_since, self.failures = None, 0
        return was


async def every(
    interval_s: float,
    step: Callable[[], object],
    what: str,
    log: logging.Logger,
    *,
    clock: Callable[[], float] | None = None,
) -> None:
    """Run `step` (a function or a coroutine function; its result is ignored) every
    `interval_s` until cancelled; an error is logged, never fatal."""
    errors = ErrorLog()
    now = clock or asyncio.get_running_loop().time
    while True:
        await asyncio.sleep(interval_s)
        try:
            result = step()
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception as e:
            _log_failure(errors, now(), what, e, log)
        else:
            if errors.succeeded():
                log.warning("%s works again", what)


def _log_failure(errors: ErrorLog, now: float, what: str, e: Exception,
                 log: logging.Logger) -> None:
    verdict = errors.failed(now)
    if verdict is None:
        return
    kind, n = verdict
    if kind == "first":
        # an OSError (a full disk) says all in its message; anything else gets a traceback
        log.error("%s failed (will retry): %s", what, e, exc_info=not isinstance(e, OSError))
    else:
        log.error("%s still failing (%d failures since the last line): %s", what, n, e)
