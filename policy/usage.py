"""`stockade rules usage`: what each entry of each profile did in recorded events.

A pure core: a rule set and an iterable of event dicts in, one `EntryUsage` per profile
entry (and per broker grant) out. Which entry an event used is its `rule.id` under its
`labels.profile` (connection, request and DNS decisions; a connection's bytes come from
its `connection_close`); a broker call is its profile's grant for `stockade.api`.
Summaries (`event_summary`) carry no rule id: their denials still count as denials near
an entry, their allowed counts are reported as unattributed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date
from typing import Any, Literal

from . import eventlog as ev
from .model import EgressEntry
from .ruleset import RuleSet

Kind = Literal["allow", "deny", "broker"]
Event = dict[str, Any]


@dataclass
class EntryUsage:
    profile: str
    entry: str  # the entry's id; `broker:<api>` for a broker grant
    kind: Kind
    target: str  # host pattern, CIDR or API name
    origin: str = ""
    owner: str | None = None
    review_by: date | None = None
    expires: date | None = None
    hits: int = 0
    tasks: set[str] = field(default_factory=set)
    bytes_up: int = 0
    bytes_down: int = 0
    last_use: float | None = None
    served: Counter[str] = field(default_factory=Counter)  # names a wildcard entry served
    denials_near: Counter[str] = field(default_factory=Counter)  # denied names close by
    status: list[str] = field(default_factory=list)

    @property
    def wildcard(self) -> bool:
        return self.kind != "broker" and self.target.startswith("*.")

    @property
    def stale(self) -> bool:
        """Fails `--fail-on-stale`: unused, expired or overdue for review."""
        return any(s in ("unused", "expired", "review overdue") for s in self.status)

    def use(self, e: Event, t: float) -> None:
        self.hits += 1
        task = ev.task_id(e)
        if task:
            self.tasks.add(task)
        self.last_use = t if self.last_use is None else max(self.last_use, t)
        name = ev.destination(e)
        if self.wildcard and name:
            self.served[name] += 1


@dataclass
class UsageReport:
    entries: list[EntryUsage]
    since: float | None  # events before this were not counted
    until: float
    events: int = 0  # events in the window
    undated: int = 0  # events without a readable @timestamp (not counted)
    unattributed_allowed: int = 0  # allowed events only summaries counted (no rule id)
    # (profile, rule id) -> hits for ids the rule set does not have (removed or renamed)
    unknown: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def stale(self) -> list[EntryUsage]:
        return [u for u in self.entries if u.stale]


def _entry_usage(profile: str, e: EgressEntry, kind: Kind) -> EntryUsage:
    return EntryUsage(profile, e.id, kind, e.host or str(e.cidr), e.origin, e.owner,
                      e.review_by, e.expires)  # fmt: skip


def _table(rs: RuleSet) -> dict[tuple[str, str], EntryUsage]:
    out: dict[tuple[str, str], EntryUsage] = {}
    for p in rs.profiles.values():
        for kind, entries in (("allow", p.allow), ("deny", p.deny)):
            for e in entries:
                out.setdefault((p.name, e.id), _entry_usage(p.name, e, kind))  # type: ignore[arg-type]
        for api in p.broker:
            out[(p.name, f"broker:{api}")] = EntryUsage(p.name, f"broker:{api}", "broker", api)
    return out


def near(pattern: str, name: str) -> bool:
    """Is `name` close to the entry's host `pattern`: the host itself, or a name under
    the host's parent domain (`upload.pypi.org` near `pypi.org`, `x.cdn.example` near
    `*.cdn.example`)? Where the parent would be a bare TLD, the host stands for it."""
    base = pattern[2:] if pattern.startswith("*.") else pattern
    parent = base.split(".", 1)[1] if base.count(".") >= 2 else base
    return name in (base, parent) or name.endswith("." + parent)


class _Tally:
    """Feeds events into the table; one method per kind of event."""

    def __init__(self, rs: RuleSet, report: UsageReport) -> None:
        self.table = _table(rs)
        self.report = report
        self.hosts: dict[str, list[EntryUsage]] = {}  # profile -> its host allow entries
        for u in self.table.values():
            if u.kind == "allow" and "/" not in u.target:  # a host, not a CIDR
                self.hosts.setdefault(u.profile, []).append(u)

    def feed(self, e: Event, t: float) -> None:
        act, prof = ev.action(e), ev.profile(e)
        if prof is None:
            return
        if act in ev.DECISIONS:
            self._decision(e, t, prof)
        elif act == "connection_close":
            u = self.table.get((prof, ev.rule_id(e) or ""))
            if u is not None:
                u.bytes_up += ev.bytes_up(e)
                u.bytes_down += ev.bytes_down(e)
        elif act == "broker_call":
            self._broker(e, t, prof)
        elif act == "event_summary":
            self._summary(e, prof)

    def _decision(self, e: Event, t: float, prof: str) -> None:
        rid = ev.rule_id(e)
        # report mode lets a denied flow through: the rules still denied it
        denied = ev.outcome(e) == "denied" or bool(ev.get(e, "stockade.report_only"))
        if rid:
            u = self.table.get((prof, rid))
            if u is None:
                self.report.unknown[(prof, rid)] += 1
            elif u.kind == "deny" or not denied:
                u.use(e, t)
        if denied:
            self._near(prof, ev.destination(e), 1)

    def _broker(self, e: Event, t: float, prof: str) -> None:
        api = ev.get(e, "stockade.api")
        u = self.table.get((prof, f"broker:{api}")) if isinstance(api, str) else None
        if u is None or ev.outcome(e) != "allowed":
            return
        u.use(e, t)
        u.bytes_up += ev.bytes_up(e)
        u.bytes_down += ev.bytes_down(e)

    def _summary(self, e: Event, prof: str) -> None:
        n = ev.get(e, "stockade.summary.count")
        n = n if isinstance(n, int) and n > 0 else 0
        if ev.get(e, "stockade.summary.action") not in ev.DECISIONS:
            return
        if ev.outcome(e) == "denied":
            self._near(prof, ev.destination(e), n)
        elif ev.outcome(e) == "allowed":
            self.report.unattributed_allowed += n

    def _near(self, prof: str, name: str | None, n: int) -> None:
        if not name or not n:
            return
        for u in self.hosts.get(prof, ()):
            if near(u.target, name):
                u.denials_near[name] += n


def _status(u: EntryUsage, today: date, expiring_within: int) -> list[str]:
    out = []
    if u.hits == 0 and u.kind != "deny":  # a deny that never fired is a guard, not waste
        out.append("unused")
    if u.expires is not None:
        days = (u.expires - today).days
        if days < 0:
            out.append("expired")
        elif days < expiring_within:
            out.append(f"expires in {days}d")
    if u.review_by is not None and u.review_by < today:
        out.append("review overdue")
    return out


def usage(
    rs: RuleSet,
    events: Iterable[Event],
    now: float,
    since: float | None,
    today: date,
    expiring_within: int = 14,
) -> UsageReport:
    """Per profile entry: hits, tasks, bytes, last use, names served, denials near it,
    counting the events from `since` (epoch seconds; None: all); `now` is the report's
    end (later events, a clock ahead, still count)."""
    report = UsageReport([], since, now)
    tally = _Tally(rs, report)
    for e in events:
        t = ev.when(e)
        if t is None:
            report.undated += 1
            continue
        if since is not None and t < since:
            continue
        report.events += 1
        tally.feed(e, t)
    report.entries = sorted(tally.table.values(), key=lambda u: (u.profile, u.kind, u.entry))
    for u in report.entries:
        u.status = _status(u, today, expiring_within)
    return report
