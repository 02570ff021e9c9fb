"""The pure name guards the TCP path shares with the DNS firewall (gateway/dns/guards.py)."""

from __future__ import annotations

from stockade.gateway.dns.guards import GuardState, NameLimits, name_violation
from stockade.gateway.dns.settings import DnsSettings
from stockade.policy.reasons import Reason

LIMITS = NameLimits(max_label_length=40, max_name_length=120)


def test_limits_come_from_the_dns_settings() -> None:
    s = DnsSettings(max_label_length=30, max_name_length=100, entropy_threshold_bits=3.5)
    assert NameLimits.from_settings(s) == NameLimits(30, 100, 16, 3.5)


def test_name_violations_in_the_dns_firewall_order() -> None:
    assert name_violation("pypi.org", LIMITS) is None
    assert name_violation("a" * 41 + ".tunnel.test", LIMITS) == Reason.LABEL_TOO_LONG
    long_name = ".".join(["abcdefghijklmnopqrstuvwxyz"] * 5) + ".tunnel.test"
    assert name_violation(long_name, LIMITS) == Reason.NAME_TOO_LONG
    assert name_violation("q7x2m9k4v8z1n6b3w5c0.tunnel.test", LIMITS) == (Reason.HIGH_ENTROPY_LABEL)
    # short labels are not judged on entropy; hex stays under 4 bits/char
    assert name_violation("q7x2m9k4v8z1n6b.tunnel.test", LIMITS) is None
    assert name_violation("0123456789abcdef0123.tunnel.test", LIMITS) is None


def test_lookups_in_flight_count_against_the_budget() -> None:
    g = GuardState(rate=50, burst=100, unresolvable_cap=3)
    pending = {"a.t": 1, "b.t": 1}
    assert not g.unresolvable_exhausted_pending("t1", "r", "c.t", 0.0, pending)
    pending["c.t"] = 1
    # three distinct names in flight: a fourth must wait for the budget
    assert g.unresolvable_exhausted_pending("t1", "r", "d.t", 0.0, pending)
    # a name already in flight or already counted is never refused by the budget
    assert not g.unresolvable_exhausted_pending("t1", "r", "a.t", 0.0, pending)
    g.record_unresolvable("t1", "r", "a.t", 1.0)
    assert g.unresolvable_exhausted_pending("t1", "r", "d.t", 1.0, {"b.t": 1, "c.t": 1})
    assert not g.unresolvable_exhausted_pending("t1", "r", "d.t", 1.0, {"a.t": 1})
    # another allow entry or another task has its own budget
    assert not g.unresolvable_exhausted_pending("t1", "other", "d.t", 1.0, {})
    assert not g.unresolvable_exhausted_pending("t2", "r", "d.t", 1.0, {})


def test_tcp_path_budget_refusals_log_once_then_summarise() -> None:
    from stockade.gateway.dns.namebudget import Budget
    from stockade.gateway.name_refusals import budget_denial, name_budget_summaries

    from stockade.events import validate
    from stockade.tasks.registry import Task

    g = GuardState(rate=50, burst=100, unresolvable_cap=3)
    first = budget_denial(g, "t1", "wild", Budget.ENCODED_NAMES, 1.0)
    assert first.log and first.reason == Reason.NAME_BUDGET_EXCEEDED
    assert first.extra == {"name_budget": "encoded_names"}
    later = [budget_denial(g, "t1", "wild", Budget.ENCODED_NAMES, 2.0) for _ in range(7)]
    assert not any(d.log for d in later)
    # the DNS path's refusals of the same task are its own (each path logs its first)
    assert g.names.refusal_event_due("t1", "dns", "wild", Budget.ENCODED_NAMES, 2.0) == 0
    (summary,) = name_budget_summaries(g, Task("t1", "10.9.0.2", "names"))
    validate(summary)
    assert summary["event"]["reason"] == "name_budget_exceeded"
    assert summary["stockade"]["suppressed_events"] == 7
    assert summary["rule"]["id"] == "wild"
    assert name_budget_summaries(g, Task("t1", "10.9.0.2", "names")) == []
