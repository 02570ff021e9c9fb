"""The fence self-test's marker queries take no token of the task's query rate (the DNS
firewall's per-task budget, gateway/dns/guards.py): a task's rate budget after its
self-test is the budget of a task without one; a sandbox naming markers gets a few."""

from __future__ import annotations

import dns.message
from stockade.gateway.dns.decide import Outcome, precheck
from stockade.gateway.dns.guards import GuardState
from stockade.gateway.dns.packet import parse_query
from stockade.gateway.dns.settings import DnsSettings
from stockade.policy.ruleset import RuleSet

from stockade.events.probemark import PROBES_PER_TASK, marker
from stockade.tasks import Task

BURST = 5


def _ask(g: GuardState, ruleset: RuleSet, task: Task, name: str) -> object:
    s = DnsSettings(queries_per_second=0.001, query_burst=BURST)
    q = parse_query(dns.message.make_query(name, "A").to_wire())
    return precheck(q, task, ruleset, s, g, now=1.0)


def _rate_refused(out: object) -> bool:
    return isinstance(out, Outcome) and out.reason == "query_rate_exceeded"


def test_marker_queries_spend_no_query_rate(ruleset: RuleSet) -> None:
    g = GuardState(0.001, BURST, 10)
    probed, plain = Task("a1", "10.9.0.2", "dns-test"), Task("b2", "10.9.0.3", "dns-test")
    for role in ("dns", "resolver"):
        out = _ask(g, ruleset, probed, marker(role, probed.task_id).upper())
        assert isinstance(out, Outcome) and out.reason == "no_matching_rule", out
    after = [_rate_refused(_ask(g, ruleset, probed, "other.test")) for _ in range(BURST + 2)]
    without = [_rate_refused(_ask(g, ruleset, plain, "other.test")) for _ in range(BURST + 2)]
    assert after == without == [False] * BURST + [True, True]


def test_a_sandbox_naming_markers_is_rate_limited_past_a_few(ruleset: RuleSet) -> None:
    g = GuardState(0.001, BURST, 10)
    t = Task("c3", "10.9.0.4", "dns-test")
    outs = [_rate_refused(_ask(g, ruleset, t, marker("x", "c3")))
            for _ in range(PROBES_PER_TASK + BURST + 1)]
    assert outs == [False] * (PROBES_PER_TASK + BURST) + [True]
