"""When to restart a component that died, and when to give up (pure; `now` is given).

Exponential backoff, capped; a component that stayed up `stable_after_s` starts over from
the first delay; after `max_fast_failures` deaths in a row that each came sooner, give up
(a component that cannot start must end `stockade up` with its error, not loop forever).
"""

from __future__ import annotations

from dataclasses import dataclass

from .settings import StackSettings


@dataclass
class RestartTracker:
    policy: StackSettings
    started_at: float | None = None
    failures: int = 0  # deaths in a row, each within stable_after_s of its start

    def started(self, now: float) -> None:
        self.started_at = now

    def exited(self, now: float) -> float | None:
        """The delay before the restart, or None: give up."""
        p = self.policy
        if self.started_at is not None and now - self.started_at >= p.stable_after_s:
            self.failures = 0
        self.failures += 1
        self.started_at = None
        if self.failures > p.max_fast_failures:
            return None
        return float(min(p.restart_delay_s * 2 ** (self.failures - 1), p.restart_delay_max_s))
