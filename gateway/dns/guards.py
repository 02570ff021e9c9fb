"""DNS tunnelling guards and their per-task state. Pure: every call takes `now`.

Hand-written because each guard is a few lines of arithmetic tied to our per-task,
per-rule bookkeeping; no library models "distinct unresolvable names per minute under
one allow entry". Memory per task is bounded by the configured caps.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from stockade.policy.reasons import Reason

from stockade.events.probemark import PROBES_PER_TASK, is_marker_labels

from .namebudget import Budget, NameBudget, NameBudgetLimits, wildcard_suffix
from .settings import settings_view

if TYPE_CHECKING:
    from stockade.policy.ruleset import RuleSet

    from .settings import DnsSettings

WINDOW_S = 60.0  # the "per minute" of the unresolvable-name budget


def shannon_entropy(label: bytes) -> float:
    """Bits per character of `label` (0 for empty)."""
    n = len(label)
    if n == 0:
        return 0.0
    return -sum((c / n) * math.log2(c / n) for c in Counter(label.lower()).values())


@dataclass(slots=True)
class TokenBucket:
    rate: float  # tokens per second
    burst: float
    tokens: float
    stamp: float

    @classmethod
    def full(cls, rate: float, burst: int, now: float) -> TokenBucket:
        return cls(rate, float(burst), float(burst), now)

    def take(self, now: float) -> bool:
        elapsed = max(0.0, now - self.stamp)
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(slots=True)
class UnresolvableWindow:
    """Distinct unresolvable names seen under one allow entry in the last minute."""

    seen: dict[str, float] = field(default_factory=dict)  # name -> last seen

    def prune(self, now: float) -> None:
        if self.seen:
            cutoff = now - WINDOW_S
            for name in [n for n, t in self.seen.items() if t <= cutoff]:
                del self.seen[name]

    def exhausted(self, name: str, cap: int, now: float) -> bool:
        """True when `name` would be one distinct name too many."""
        self.prune(now)
        return name not in self.seen and len(self.seen) >= cap

    def record(self, name: str, cap: int, now: float) -> None:
        self.prune(now)
        if name in self.seen or len(self.seen) < cap:
            self.seen[name] = now


@dataclass(slots=True)
class TaskGuards:
    bucket: TokenBucket
    unresolvable: dict[str, UnresolvableWindow] = field(default_factory=dict)  # per rule id
    suppressed_rate_events: int = 0
    last_rate_event: float = -math.inf
    probes: int = 0  # the fence self-test's marker queries let past the query rate


class GuardState:
    """Per-task guard state, created on first query and dropped when the task ends."""

    def __init__(
        self,
        rate: float,
        burst: int,
        unresolvable_cap: int,
        names: NameBudgetLimits | None = None,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.unresolvable_cap = unresolvable_cap
        self.names = NameBudget(names or NameBudgetLimits())
        self._tasks: dict[str, TaskGuards] = {}

    @classmethod
    def from_settings(cls, s: DnsSettings) -> GuardState:
        return cls(
            s.queries_per_second,
            s.query_burst,
            s.unresolvable_names_per_minute,
            NameBudgetLimits.from_settings(s),
        )

    def task(self, task_id: str, now: float) -> TaskGuards:
        g = self._tasks.get(task_id)
        if g is None:
            g = TaskGuards(TokenBucket.full(self.rate, self.burst, now))
            self._tasks[task_id] = g
        return g

    def forget(self, task_id: str) -> None:
        self._tasks.pop(task_id, None)
        self.names.forget(task_id)

    def admit_name(
        self,
        task_id: str,
        ruleset: RuleSet,
        profile: str,
        name: str,
        rule_id: str | None,
        now: float,
    ) -> Budget | None:
        """Charge a name about to be resolved to the task's name budgets (only names under
        wildcard entries are budgeted): None when admitted, else the budget exceeded."""
        suffix = wildcard_suffix(ruleset, profile, name, rule_id)
        if suffix is None:
            return None
        return self.names.admit(task_id, rule_id or "", suffix, name, now)

    def allow_query(self, task_id: str, now: float) -> bool:
        return self.task(task_id, now).bucket.take(now)

    def probe_query(self, task_id: str, labels: tuple[bytes, ...], now: float) -> bool:
        """A fence self-test's marker query (stockade/events/probemark.py): it takes no
        token of the task's query rate, up to PROBES_PER_TASK of them."""
        if not is_marker_labels(labels):
            return False
        g = self.task(task_id, now)
        if g.probes >= PROBES_PER_TASK:
            return False
        g.probes += 1
        return True

    def unresolvable_exhausted(self, task_id: str, rule: str, name: str, now: float) -> bool:
        w = self.task(task_id, now).unresolvable.get(rule)
        return w is not None and w.exhausted(name, self.unresolvable_cap, now)

    def record_unresolvable(self, task_id: str, rule: str, name: str, now: float) -> None:
        g = self.task(task_id, now)
        w = g.unresolvable.setdefault(rule, UnresolvableWindow())
        w.record(name, self.unresolvable_cap, now)

    def unresolvable_exhausted_pending(
        self, task_id: str, rule: str, name: str, now: float, pending: Collection[str]
    ) -> bool:
        """`unresolvable_exhausted`, also counting `pending` names (lookups still in
        flight, any of which may fail): a burst of concurrent lookups of distinct names
        cannot overshoot the budget before the first failures are recorded."""
        w = self.task(task_id, now).unresolvable.get(rule)
        seen: dict[str, float] = {}
        if w is not None:
            w.prune(now)
            seen = w.seen
        if name in seen or name in pending:
            return False
        in_flight = sum(1 for n in pending if n not in seen)
        return len(seen) + in_flight >= self.unresolvable_cap

    def rate_event_due(self, task_id: str, now: float) -> int | None:
        """Denials for rate are logged at most once a second per task; returns the count
        of suppressed ones to report, or None when this one is suppressed."""
        g = self.task(task_id, now)
        if now - g.last_rate_event >= 1.0:
            n = g.suppressed_rate_events
            g.suppressed_rate_events = 0
            g.last_rate_event = now
            return n
        g.suppressed_rate_events += 1
        return None


# -- name-shape guards shared with the TCP path ----------------------------------------
# A sandbox can tunnel through names it never asks DNS about: SNI, Host and CONNECT
# authorities under an allowed wildcard make the gateway resolve them, and the upstream
# query is the channel. The gateway's TCP path applies these same limits, and the same
# GuardState budget, to every name it is about to resolve.


@dataclass(frozen=True, slots=True)
class NameLimits:
    """The name-shape limits of the `dns:` settings (one source for both paths)."""

    max_label_length: int = 63
    max_name_length: int = 253
    entropy_min_label_length: int = 16
    entropy_threshold_bits: float = 4.0

    @classmethod
    def from_settings(cls, settings: DnsSettings) -> NameLimits:
        return settings_view(cls, settings)


@dataclass(frozen=True, slots=True)
class GuardDenial:
    """Why the TCP path must not resolve a name, and how to log the refusal."""

    reason: Reason
    detail: str
    extra: dict[str, object] = field(default_factory=dict)  # event fields under `stockade`
    log: bool = True  # False: counted (metrics, a later summary), no event


@lru_cache(maxsize=8192)
def name_violation(name: str, limits: NameLimits) -> Reason | None:
    """Why a normalised presentation-form name must not be resolved, or None. Checked in
    the DNS firewall's order: label length, name length, label entropy. (Cached: the same
    few names make up nearly every connection.)"""
    labels = name.split(".")
    if any(len(label) > limits.max_label_length for label in labels):
        return Reason.LABEL_TOO_LONG
    if len(name) > limits.max_name_length:
        return Reason.NAME_TOO_LONG
    for label in labels:
        if (
            len(label) >= limits.entropy_min_label_length
            and shannon_entropy(label.encode("ascii", "replace")) >= limits.entropy_threshold_bits
        ):
            return Reason.HIGH_ENTROPY_LABEL
    return None
