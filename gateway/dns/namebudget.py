"""Per-task name budgets under wildcard allow entries. Pure: every call takes `now`.

A wildcard entry (`*.example.test`) whose zone answers every name is an open channel: a
task can spell data into the names it asks (DNS queries, SNI, Host, CONNECT), and the
gateway's upstream lookup carries it out, resolved or not. Three sliding-window budgets
per task bound it, counted when a name is admitted for resolution (cache hit or miss,
whether it then resolves or not):

- `names_per_entry` distinct names per wildcard entry;
- `name_bytes` bytes of distinct names across all wildcard entries;
- `encoded_names` distinct names with an encoded-looking label (`labelshape.py`).

A name already admitted in the window is always admitted again (it carries nothing new).
Names under exact-name entries are not budgeted: the rules fix that set of names.

Refusals are logged once per (task, path, entry, budget) verbatim, then counted: a later
refusal at least `summary_interval_s` after the last logged one is logged with the count
in between, and the rest are handed back as a summary when the task ends.

Hand-written because the windows are ordered dicts and a few integers tied to our
per-task, per-entry keys; no rate-limit library counts distinct names with a byte total.
Memory per task is bounded: each window holds at most its cap of names (the byte window
at most `name_bytes` characters of names), refusal counters one per entry and budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from .labelshape import name_shape
from .settings import settings_view

if TYPE_CHECKING:
    from stockade.policy.ruleset import RuleSet

    from .settings import DnsSettings

SUMMARY_INTERVAL_S = 60.0  # a refusal after this long without an event is logged again


class Budget(StrEnum):
    """Which budget refused a name (`stockade.name_budget` in events)."""

    ENTRY_NAMES = "entry_names"
    NAME_BYTES = "name_bytes"
    ENCODED_NAMES = "encoded_names"


DETAIL = {
    Budget.ENTRY_NAMES: "too many distinct names under this wildcard allow entry",
    Budget.NAME_BYTES: "too many bytes of distinct names under wildcard allow entries",
    Budget.ENCODED_NAMES: "too many distinct encoded-looking names under wildcard entries",
}


@dataclass(frozen=True, slots=True)
class NameBudgetLimits:
    window_s: float = 600.0
    names_per_entry: int = 64
    name_bytes: int = 4096
    encoded_names: int = 16
    encoded_min_label_length: int = 10

    @classmethod
    def from_settings(cls, s: DnsSettings) -> NameBudgetLimits:
        return settings_view(cls, s, window_s="name_budget_window_s",
                             names_per_entry="wildcard_names_per_window",
                             name_bytes="name_bytes_per_window",
                             encoded_names="encoded_names_per_window")  # fmt: skip


@dataclass(slots=True)
class DistinctWindow:
    """Distinct names last seen within the window, oldest first, and their total length."""

    seen: OrderedDict[str, float] = field(default_factory=OrderedDict)
    total: int = 0

    def prune(self, now: float, window_s: float) -> None:
        cutoff = now - window_s
        seen = self.seen
        while seen:
            name, stamp = next(iter(seen.items()))
            if stamp > cutoff:
                return
            del seen[name]
            self.total -= len(name)

    def add(self, name: str, now: float) -> None:
        if name in self.seen:
            self.seen.move_to_end(name)
        else:
            self.total += len(name)
        self.seen[name] = now


@dataclass(slots=True)
class TaskNames:
    per_entry: dict[str, DistinctWindow] = field(default_factory=dict)
    all: DistinctWindow = field(default_factory=DistinctWindow)
    encoded: DistinctWindow = field(default_factory=DistinctWindow)


@dataclass(slots=True)
class RefusalLog:
    last_logged: float
    suppressed: int = 0


@dataclass(frozen=True, slots=True)
class RefusalSummary:
    rule: str
    budget: Budget
    suppressed: int

    @property
    def message(self) -> str:
        return f"{self.suppressed} more names refused while the task ran: {DETAIL[self.budget]}"

    @property
    def extra(self) -> dict[str, object]:  # event fields under `stockade`
        return {"name_budget": str(self.budget), "suppressed_events": self.suppressed}


def wildcard_suffix(ruleset: RuleSet, profile: str, name: str, rule_id: str | None) -> str | None:
    """The suffix of the wildcard entry `rule_id` that `name` falls under ("" when no entry
    matched, as in report mode: every label counts), or None when `name` is allowed by an
    exact-name entry and needs no budget."""
    cp = ruleset.compiled.get(profile)
    if cp is None or rule_id is None:
        return ""
    if any(e.id == rule_id for e in cp.allow.exact.get(name, ())):
        return None
    for e in cp.allow.by_name(name):
        if e.id == rule_id and e.host is not None and e.host.startswith("*."):
            return e.host[2:]
    return ""


class NameBudget:
    """The three name budgets and their refusal logs, for every task."""

    def __init__(self, limits: NameBudgetLimits) -> None:
        self.limits = limits
        self._tasks: dict[str, TaskNames] = {}
        # (task, path) -> (rule, budget) -> log; kept apart from `_tasks` so each path
        # takes its own summaries when the task ends, whichever forgets the task first
        self._refusals: dict[tuple[str, str], dict[tuple[str, Budget], RefusalLog]] = {}

    def admit(self, task_id: str, rule: str, suffix: str, name: str, now: float) -> Budget | None:
        """Charge `name` (under the wildcard entry `rule` with `suffix`) to the task's
        budgets: None when admitted (and recorded), else the budget it would exceed."""
        lim = self.limits
        t = self._tasks.get(task_id)
        if t is None:
            t = self._tasks[task_id] = TaskNames()
        entry = t.per_entry.get(rule)
        if entry is None:
            entry = t.per_entry[rule] = DistinctWindow()
        for w in (entry, t.all, t.encoded):
            w.prune(now, lim.window_s)
        if name in entry.seen:
            entry.add(name, now)
            t.all.add(name, now)
            if name in t.encoded.seen:
                t.encoded.add(name, now)
            return None
        if len(entry.seen) >= lim.names_per_entry:
            return Budget.ENTRY_NAMES
        if t.all.total + (0 if name in t.all.seen else len(name)) > lim.name_bytes:
            return Budget.NAME_BYTES
        head = name[: -len(suffix) - 1] if suffix and name.endswith("." + suffix) else name
        encoded = name_shape(head, lim.encoded_min_label_length) is not None
        if encoded and name not in t.encoded.seen and len(t.encoded.seen) >= lim.encoded_names:
            return Budget.ENCODED_NAMES
        entry.add(name, now)
        t.all.add(name, now)
        if encoded:
            t.encoded.add(name, now)
        return None

    def refusal_event_due(
        self, task_id: str, path: str, rule: str, budget: Budget, now: float
    ) -> int | None:
        """Whether to log this refusal: None when it is only counted, else the number of
        refusals counted since the last logged one (0 for the first)."""
        logs = self._refusals.setdefault((task_id, path), {})
        key = (rule, budget)
        log = logs.get(key)
        if log is None:
            logs[key] = RefusalLog(now)
            return 0
        if now - log.last_logged >= SUMMARY_INTERVAL_S:
            n, log.suppressed, log.last_logged = log.suppressed, 0, now
            return n
        log.suppressed += 1
        return None

    def refusal(
        self, task_id: str, path: str, rule: str, budget: Budget, now: float
    ) -> tuple[dict[str, object], bool]:
        """A refusal's event fields under `stockade`, and whether to log it (else it is
        only counted: see `refusal_event_due`)."""
        due = self.refusal_event_due(task_id, path, rule, budget, now)
        extra: dict[str, object] = {"name_budget": str(budget)}
        if due:
            extra["suppressed_events"] = due
        return extra, due is not None

    def take_summaries(self, task_id: str, path: str) -> list[RefusalSummary]:
        """The refusals of `path` counted but not logged yet, for the task's end summary;
        forgets them."""
        logs = self._refusals.pop((task_id, path), {})
        return [RefusalSummary(r, b, n.suppressed) for (r, b), n in logs.items() if n.suppressed]

    def forget(self, task_id: str) -> None:
        self._tasks.pop(task_id, None)
