"""The name budgets under wildcard allow entries (gateway/dns/namebudget.py) and the
label-shape signals (gateway/dns/labelshape.py): pure unit tests, hypothesis properties,
and the DNS decision core refusing a hex tunnel that resolves."""

from __future__ import annotations

import base64
import secrets
from typing import Any

import pytest
from dnslib import DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.gateway.dns.decide import NeedResolve, Outcome, outcome_event, precheck
from stockade.gateway.dns.guards import GuardState
from stockade.gateway.dns.labelshape import Shape, label_shape, name_shape
from stockade.gateway.dns.namebudget import Budget, NameBudget, NameBudgetLimits
from stockade.gateway.dns.packet import parse_query
from stockade.gateway.dns.settings import DnsSettings
from stockade.policy.ruleset import RuleSet

from stockade.events import validate
from stockade.tasks.registry import Task

LIMITS = NameBudgetLimits(
    window_s=600.0, names_per_entry=8, name_bytes=4096, encoded_names=4, encoded_min_label_length=10
)


def test_label_shapes() -> None:
    cases = {
        "deadbeefcafe0123": Shape.HEX,
        "mfrggzdfmztwq2lk": Shape.BASE32,
        "x9k2m4p7q1w8z3": Shape.BASE64,
        "build20240101": Shape.DIGITS,
        "a123456": Shape.DIGITS,  # digit runs count at any length
        # words, host names and CDN-style names are not encoded-looking
        "files": None,
        "pythonhosted": None,
        "githubusercontent": None,
        "authentication": None,
        "s3-website-us-east-1": None,
        "ip-10-0-0-1": None,
        "ubuntu2204": None,
        "deadbeef": None,  # shorter than the minimum length
    }
    assert {label: label_shape(label, 10) for label in cases} == cases
    assert name_shape("files.pythonhosted.org", 10) is None
    assert name_shape("www.0a1b2c3d4e5f6a7b.tunnel.test", 10) is Shape.HEX


def test_distinct_names_per_entry_whether_or_not_they_resolve() -> None:
    b = NameBudget(LIMITS)
    names = [f"n{i}.wild.test" for i in range(8)]
    assert [b.admit("t1", "wild", "wild.test", n, 1.0) for n in names] == [None] * 8
    assert b.admit("t1", "wild", "wild.test", "n8.wild.test", 2.0) is Budget.ENTRY_NAMES
    # a name already admitted is admitted again: it carries nothing new
    assert b.admit("t1", "wild", "wild.test", names[3], 3.0) is None
    # another entry and another task have their own count
    assert b.admit("t1", "other", "other.test", "n8.other.test", 3.0) is None
    assert b.admit("t2", "wild", "wild.test", "n8.wild.test", 3.0) is None
    # the window slides: names not asked again for window_s free their slots
    assert b.admit("t1", "wild", "wild.test", "n8.wild.test", 601.5) is None
    # (n3 was asked again at 3.0, so it holds its slot until 603)
    assert b.admit("t1", "wild", "wild.test", "n9.wild.test", 601.5) is None


def test_unique_name_bytes_per_task_across_entries() -> None:
    b = NameBudget(NameBudgetLimits(names_per_entry=1000, name_bytes=300, encoded_names=1000))
    label = "abcdefghijklmnopqrstuvwxy"  # 25 letters, a word-like label
    used = 0
    i = 0
    while True:
        name = f"{label}{chr(97 + i % 26)}{chr(97 + i // 26)}.e{i % 3}.test"
        got = b.admit("t1", f"e{i % 3}", f"e{i % 3}.test", name, 1.0)
        if got is not None:
            assert got is Budget.NAME_BYTES
            break
        used += len(name)
        i += 1
    assert used <= 300 < used + len(name)


def test_encoded_looking_names_have_a_lower_budget() -> None:
    b = NameBudget(LIMITS)
    hexes = [f"{secrets.token_hex(8)}.wild.test" for _ in range(5)]
    assert [b.admit("t1", "w", "wild.test", n, 1.0) for n in hexes[:4]] == [None] * 4
    assert b.admit("t1", "w", "wild.test", hexes[4], 1.0) is Budget.ENCODED_NAMES
    # plain names still fit under the per-entry budget
    assert b.admit("t1", "w", "wild.test", "www.wild.test", 1.0) is None
    # the entry's own suffix is not judged: it is the security team's choice
    b2 = NameBudget(LIMITS)
    assert all(
        b2.admit("t1", "w", "0123456789abcdef.cdn.test", f"n{i}.0123456789abcdef.cdn.test", 1.0)
        is None
        for i in range(8)
    )


def test_refusals_are_logged_once_then_summarised() -> None:
    b = NameBudget(LIMITS)
    assert b.refusal_event_due("t1", "dns", "w", Budget.ENTRY_NAMES, 1.0) == 0
    assert [b.refusal_event_due("t1", "dns", "w", Budget.ENTRY_NAMES, 2.0) for _ in range(5)] == [
        None
    ] * 5
    # the other path logs its own first refusal
    assert b.refusal_event_due("t1", "gateway", "w", Budget.ENTRY_NAMES, 2.0) == 0
    # a minute later the next refusal is logged with the count in between
    assert b.refusal_event_due("t1", "dns", "w", Budget.ENTRY_NAMES, 61.0) == 5
    for _ in range(3):
        b.refusal_event_due("t1", "dns", "w", Budget.ENTRY_NAMES, 62.0)
    summaries = b.take_summaries("t1", "dns")
    assert [(s.rule, s.budget, s.suppressed) for s in summaries] == [
        ("w", Budget.ENTRY_NAMES, 3)
    ]
    assert b.take_summaries("t1", "dns") == []
    assert b.take_summaries("t1", "gateway") == []  # nothing counted beyond the first


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.floats(0, 300, allow_nan=False), st.sampled_from("ab")),
        max_size=300,
    ),
    st.integers(1, 10),
    st.integers(253, 2000),
)
def test_budget_never_admits_more_than_its_caps(
    steps: list[tuple[int, float, str]], cap: int, byte_cap: int
) -> None:
    """Whatever the sequence: within any window, at most `cap` distinct names per entry
    and at most `byte_cap` bytes of distinct names are admitted; a name the window has
    forgotten (and a fresh task) is admitted again once the window passed."""
    window = 100.0
    lim = NameBudgetLimits(window, cap, byte_cap, 1000, 10)
    b = NameBudget(lim)
    now = 0.0
    admitted: list[tuple[float, str, str]] = []  # (time, entry, name), last admission
    for n, dt, entry in steps:
        now += dt
        name = f"{'x' * (n % 7)}n{n}.{entry}.test"
        if b.admit("t", entry, f"{entry}.test", name, now) is None:
            admitted = [a for a in admitted if a[2] != name] + [(now, entry, name)]
        live = [a for a in admitted if a[0] > now - window]
        for e in "ab":
            assert len({a[2] for a in live if a[1] == e}) <= cap
        assert sum(len(a[2]) for a in live) <= byte_cap
    # after a quiet window everything is free again
    assert b.admit("t", "a", "a.test", "fresh.a.test", now + window + 1) is None


# -- the decision core: a hex tunnel through a zone that answers every name ----------


def _q(name: str) -> Any:
    return parse_query(bytes(DNSRecord.question(name, "A").pack()))


@pytest.mark.parametrize("encoding", ["hex", "base32"])
def test_precheck_refuses_a_resolving_tunnel_beyond_the_budget(
    ruleset: RuleSet, encoding: str
) -> None:
    """1,000 encoded names under `*.allowed.test`: the old guards let every one through
    (hex stays under the entropy threshold, short base32 labels under its minimum length,
    and a name that resolves never touches the unresolvable budget). Now at most the
    budget's worth is handed on for resolution, one event says why."""
    s = DnsSettings(queries_per_second=1e6, query_burst=10**6)
    g = GuardState.from_settings(s)
    task = Task("t1", "10.9.0.2", "dns-test")
    passed: list[str] = []
    logged: list[Outcome] = []
    for i in range(1000):
        raw = secrets.token_bytes(9) + i.to_bytes(2, "big")
        if encoding == "hex":
            label = raw.hex()[:30]
        else:
            label = base64.b32encode(raw).decode().rstrip("=").lower()[:15]
        step = precheck(_q(f"{label}.allowed.test"), task, ruleset, s, g, now=1.0 + i / 100)
        if isinstance(step, NeedResolve):
            passed.append(step.name)
            continue
        assert step.reason == "name_budget_exceeded", step
        assert step.reply is not None and step.reply.rcode == 5  # REFUSED
        if step.log:
            logged.append(step)
    # hex labels are all encoded-looking; a short base32 label without a digit is not,
    # and then falls under the (higher) per-entry budget
    cap = s.encoded_names_per_window if encoding == "hex" else s.wildcard_names_per_window
    assert 0 < len(passed) <= cap
    # one event for the first refusal per budget, the rest counted
    budgets = [o.extra["name_budget"] for o in logged]
    assert len(budgets) == len(set(budgets)) >= 1
    ev = outcome_event(_q("x.allowed.test"), logged[0], task, "10.9.0.2", 1, "udp")
    validate(ev)
    assert ev["stockade"]["name_budget"] in ("encoded_names", "entry_names")
    assert ev["rule"]["id"] == "allowed-subdomains"
    # the exact-name entry is not budgeted; a known name is still answered
    assert isinstance(precheck(_q("allowed.test"), task, ruleset, s, g, now=20.0), NeedResolve)
    assert isinstance(precheck(_q(passed[0]), task, ruleset, s, g, now=20.0), NeedResolve)
