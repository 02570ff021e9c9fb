"""Per-task rate limits and budgets, pure: the caller passes the clock.

A token bucket per (task, api) and a budget of calls and bytes per (task, api); both
live in memory and die with the task (`forget`). Small enough that a library would
add more than it saves, and a passed-in clock makes them testable without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenBucket:
    rate: float  # tokens per second
    burst: float
    tokens: float = -1.0
    stamp: float = 0.0

    def take(self, now: float, n: float = 1.0) -> float:
        """Take `n` tokens: 0.0 on success, else the seconds until they would be there."""
        if self.tokens < 0:  # first use: a full bucket
            self.tokens, self.stamp = self.burst, now
        elapsed = max(0.0, now - self.stamp)
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
        self.stamp = now
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        if self.rate <= 0:
            return float("inf")
        return (n - self.tokens) / self.rate


@dataclass(slots=True)
class Budget:
    calls: int | None  # None = unlimited
    bytes: int | None
    used_calls: int = 0
    used_bytes: int = 0

    def exhausted(self) -> bool:
        return (self.calls is not None and self.used_calls >= self.calls) or (
            self.bytes is not None and self.used_bytes >= self.bytes
        )

    def bytes_left(self) -> int | None:
        return None if self.bytes is None else max(0, self.bytes - self.used_bytes)

    def exhaust(self) -> None:
        """A response was cut at the byte budget: nothing more for this task and API."""
        if self.bytes is not None:
            self.used_bytes = max(self.used_bytes, self.bytes)

    def charge_call(self) -> None:
        self.used_calls += 1

    def charge_bytes(self, n: int) -> None:
        self.used_bytes += n


@dataclass
class Limiter:
    """All buckets and budgets of one broker, keyed by (task_id, api)."""

    buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    budgets: dict[tuple[str, str], Budget] = field(default_factory=dict)

    def bucket(self, task_id: str, api: str, rate: float, burst: int) -> TokenBucket:
        key = (task_id, api)
        b = self.buckets.get(key)
        if b is None or b.rate != rate or b.burst != burst:  # a reload may change the grant
            b = TokenBucket(rate=rate, burst=float(max(1, burst)))
            self.buckets[key] = b
        return b

    def budget(self, task_id: str, api: str, calls: int | None, nbytes: int | None) -> Budget:
        key = (task_id, api)
        b = self.budgets.get(key)
        if b is None:
            b = Budget(calls, nbytes)
            self.budgets[key] = b
        else:  # keep what was used, follow the (possibly reloaded) limits
            b.calls, b.bytes = calls, nbytes
        return b

    def forget(self, task_id: str) -> None:
        for d in (self.buckets, self.budgets):
            for key in [k for k in d if k[0] == task_id]:
                del d[key]


@dataclass
class InFlight:
    """Calls in progress per task, capped: one task's burst of slow calls (slow upstream,
    slow body) must not take every connection and worker the broker has. Keys with no
    call in flight are dropped, so a finished task leaves nothing behind."""

    limit: int
    counts: dict[str, int] = field(default_factory=dict)

    def acquire(self, task_id: str) -> bool:
        """Take a slot for `task_id`: False (nothing taken) when it has `limit` already."""
        n = self.counts.get(task_id, 0)
        if n >= self.limit:
            return False
        self.counts[task_id] = n + 1
        return True

    def release(self, task_id: str) -> None:
        n = self.counts.get(task_id, 0) - 1
        if n > 0:
            self.counts[task_id] = n
        else:
            self.counts.pop(task_id, None)
