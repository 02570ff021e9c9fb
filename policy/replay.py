"""`stockade rules replay`: what a candidate rule set would have done to recorded traffic.

A pure core. Each recorded rule decision (connection, request, DNS, broker call) is
decided again under the candidate rules, with the facts the event carries, and compared
with what the recorded rules said. The comparison is of the rules' verdict, not of the
outcome: report mode lets a denied flow through, but it counts as denied here on both
sides. Decisions the rules did not make (a forbidden address, a name budget, a limit) are
not replayed, only counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date
from typing import Any

from . import eventlog as ev
from .decide import decide, decide_name, match_operation
from .model import RequestFacts, Verdict
from .reasons import Reason
from .ruleset import RuleSet

Event = dict[str, Any]

PASS = frozenset((Reason.ALLOWED_BY_RULE, Reason.INSPECTED))
# the reasons a rule walk gives; any other recorded reason is not the rules' doing
RULE_REASONS = PASS | frozenset((
    Reason.NO_MATCHING_RULE, Reason.DENIED_BY_RULE, Reason.PORT_NOT_ALLOWED,
    Reason.METHOD_NOT_ALLOWED, Reason.PATH_NOT_ALLOWED, Reason.INSPECTION_UNAVAILABLE,
    Reason.UNKNOWN_PROFILE, Reason.API_NOT_ALLOWED, Reason.OPERATION_NOT_ALLOWED,
))  # fmt: skip
REPLAYED = ("connection_decision", "request_decision", "dns_decision", "broker_call")


@dataclass(frozen=True, order=True)
class Flow:
    """What a decision was about, as a reviewer reads it."""

    profile: str
    kind: str  # connection / request / dns / broker
    target: str  # host:port, METHOD host/path, the DNS name, or broker API METHOD path

    def __str__(self) -> str:
        return f"{self.kind} {self.target}"


@dataclass(frozen=True, order=True)
class Change:
    flow: Flow
    now_allowed: bool
    old_rule: str  # the entry that decided before ("" when none matched)
    new_rule: str
    new_reason: str


@dataclass
class ReplayReport:
    decisions: int = 0  # rule decisions replayed
    unchanged: int = 0
    not_rules: int = 0  # decisions the rules did not make (not replayed)
    changes: Counter[Change] = field(default_factory=Counter)  # -> events

    def newly(self, allowed: bool) -> list[tuple[Change, int]]:
        return sorted((c, n) for c, n in self.changes.items() if c.now_allowed == allowed)


def _facts(e: Event, with_request: bool) -> RequestFacts:
    method, path = ev.get(e, "http.request.method"), ev.get(e, "url.path")
    ok = with_request and isinstance(method, str) and isinstance(path, str)
    return RequestFacts(host=ev.destination(e), port=ev.port(e) or 443,
                        ip=ev.get(e, "destination.ip"), method=method if ok else None,
                        path=path if ok else None)  # fmt: skip


def _passes(v: Verdict, connection: bool) -> bool:
    """The rules let it through; at the connection level an inspected entry's flow goes
    on to the inspector, which decides each request."""
    return v.reason == Reason.ALLOWED_BY_RULE or (
        connection and v.needs_inspection and v.reason == Reason.INSPECTION_UNAVAILABLE)


def _egress(rs: RuleSet, e: Event, prof: str, act: str,
            today: date) -> tuple[Flow, bool, str, str] | None:
    if act == "dns_decision":
        name = ev.destination(e)
        if not name:
            return None
        v = decide_name(rs, prof, name, today)
        ok = v.reason == Reason.ALLOWED_BY_RULE
        return Flow(prof, "dns", name), ok, v.rule_id or "", v.reason
    facts = _facts(e, True)
    if facts.host is None and facts.ip is None:
        return None
    v = decide(rs, prof, facts, today)
    dest = f"{facts.host or facts.ip}:{facts.port}"
    if act == "request_decision":
        flow = Flow(prof, "request", f"{facts.method} {dest}{facts.path}")
        return flow, _passes(v, False), v.rule_id or "", v.reason
    return Flow(prof, "connection", dest), _passes(v, True), v.rule_id or "", v.reason


def _broker(rs: RuleSet, e: Event, prof: str) -> tuple[Flow, bool, str, str] | None:
    api, method = ev.get(e, "stockade.api"), ev.get(e, "http.request.method")
    path = ev.get(e, "url.path")
    if not (isinstance(api, str) and isinstance(method, str) and isinstance(path, str)):
        return None
    p = rs.profiles.get(prof)
    grant = p.broker.get(api) if p is not None else None
    ok = grant is not None and match_operation(grant, method, path)
    reason = Reason.ALLOWED_BY_RULE if ok else (
        Reason.OPERATION_NOT_ALLOWED if grant is not None else Reason.API_NOT_ALLOWED)
    rule = f"broker:{api}" if grant is not None else ""
    return Flow(prof, "broker", f"{api} {method.upper()} {path}"), ok, rule, reason


def _replay_one(rs: RuleSet, e: Event, prof: str, act: str,
                today: date) -> tuple[Flow, bool, str, str] | None:
    if act == "broker_call":
        return _broker(rs, e, prof)
    return _egress(rs, e, prof, act, today)


def _recorded(e: Event, act: str) -> bool | None:
    """Did the recorded rules let it through; None when the rules did not decide it. A
    broker call the rules allowed keeps `allowed` even when the upstream then failed."""
    if act == "broker_call" and ev.outcome(e) == "allowed":
        return True
    reason = ev.get(e, "event.reason")
    return None if reason not in RULE_REASONS else reason in PASS


def replay(rs: RuleSet, events: Iterable[Event], today: date) -> ReplayReport:
    """Decide every recorded rule decision again under `rs` (as of `today`)."""
    r = ReplayReport()
    for e in events:
        act, prof = ev.action(e), ev.profile(e)
        if act not in REPLAYED or prof is None:
            continue
        was_ok = _recorded(e, act)
        again = None if was_ok is None else _replay_one(rs, e, prof, act, today)
        if again is None:
            r.not_rules += 1
            continue
        flow, now_ok, new_rule, new_reason = again
        r.decisions += 1
        if was_ok == now_ok:
            r.unchanged += 1
            continue
        old_rule = ev.rule_id(e) or (f"broker:{ev.get(e, 'stockade.api')}" if was_ok and
                                     act == "broker_call" else "")  # fmt: skip
        r.changes[Change(flow, now_ok, old_rule, new_rule, str(new_reason))] += 1
    return r
