"""Property tests: the matcher never crashes, and the index agrees with a naive scan."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stockade.policy import (
    HostError,
    Reason,
    RequestFacts,
    decide,
    decide_name,
    load_rules,
    normalize_host,
)
from stockade.policy.hosts import is_ip_literal

RULES = """
profile: p
egress:
  allow:
    - {host: a.test, reason: r}
    - {host: "*.b.test", reason: r, ports: [443, 80]}
    - {host: "*.c.b.test", reason: r, id: deeper}
    - {host: x.test, reason: r, http: {methods: [GET], paths: ["/ok/**"]}}
    - {cidr: 10.0.0.0/8, reason: r, ports: [22]}
    - {cidr: "fd00::/8", reason: r}
  deny:
    - {host: bad.b.test, reason: r}
    - {cidr: 10.9.0.0/16, reason: r}
"""


def _ruleset(tmp: Path):
    (tmp / "profiles").mkdir(parents=True, exist_ok=True)
    (tmp / "profiles" / "p.yaml").write_text(RULES)
    return load_rules(tmp)


# the rule set is rebuilt per example from tmp_path; that is intended
NO_FIXTURE_CHECK = [HealthCheck.function_scoped_fixture]
anything = st.text(max_size=120)
nameish = st.text(alphabet=st.sampled_from(list("abcx.t-*@[]:1 0\u00fc\u3002\uff22E")), max_size=40)


@settings(max_examples=500, deadline=None, suppress_health_check=NO_FIXTURE_CHECK)
@given(
    host=st.one_of(st.none(), anything, nameish),
    port=st.integers(min_value=-5, max_value=70000),
    ip=st.one_of(st.none(), anything, st.ip_addresses().map(str)),
    method=st.one_of(st.none(), st.sampled_from(["GET", "post", "", "G E T"]), anything),
    path=st.one_of(st.none(), anything, st.just("/ok/a/b")),
)
def test_decide_never_crashes(tmp_path, host, port, ip, method, path):
    rs = _ruleset(tmp_path)
    v = decide(rs, "p", RequestFacts(host=host, port=port, ip=ip, method=method, path=path))
    assert isinstance(v.reason, Reason) and v.policy_version == rs.version
    if v.allowed:
        assert v.reason == Reason.ALLOWED_BY_RULE and v.rule_id is not None
    w = decide_name(rs, "p", host if host is not None else "")
    assert w.allowed == (w.reason == Reason.ALLOWED_BY_RULE)


def naive_match(pattern: str, name: str) -> bool:
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and name != pattern[2:]
    return name == pattern


@settings(max_examples=300, deadline=None, suppress_health_check=NO_FIXTURE_CHECK)
@given(
    st.lists(st.sampled_from(["a", "b", "c", "bad", "x", "test", "zz"]), min_size=1, max_size=5)
)
def test_index_agrees_with_naive_scan(tmp_path, parts):
    rs = _ruleset(tmp_path)
    name = ".".join(parts)
    try:
        norm = normalize_host(name)
    except HostError:
        return
    if is_ip_literal(norm):
        return
    p = rs.profiles["p"]
    denied = any(e.host and naive_match(e.host, norm) for e in p.deny)
    allowed = any(e.host and naive_match(e.host, norm) for e in p.allow)
    v = decide_name(rs, "p", name)
    assert v.allowed == (allowed and not denied)
    assert v.reason == (
        Reason.DENIED_BY_RULE if denied else
        Reason.ALLOWED_BY_RULE if allowed else Reason.NO_MATCHING_RULE
    )  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=NO_FIXTURE_CHECK)
@given(st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)), st.sampled_from([22, 443]))
def test_cidr_index_agrees_with_naive_scan(tmp_path, ip, port):
    rs = _ruleset(tmp_path)
    p = rs.profiles["p"]

    def hit(e) -> bool:  # type: ignore[no-untyped-def]
        return e.cidr is not None and e.cidr.version == ip.version and ip in e.cidr

    denied = any(hit(e) for e in p.deny)
    matching = [e for e in p.allow if hit(e)]
    v = decide(rs, "p", RequestFacts(ip=str(ip), port=port))
    if denied:
        assert v.reason == Reason.DENIED_BY_RULE
    elif not matching:
        assert v.reason == Reason.NO_MATCHING_RULE
    else:
        assert v.allowed == any(port in e.ports for e in matching)
    assert ipaddress.ip_address(str(ip)) == ip


@settings(max_examples=200, deadline=None, suppress_health_check=NO_FIXTURE_CHECK)
@given(st.sampled_from(["a.test", "q.b.test", "q.c.b.test", "bad.b.test", "b.test", "x.test"]),
       st.booleans(), st.booleans())  # fmt: skip
def test_spelling_never_changes_the_verdict(tmp_path, name, upper, dot):
    rs = _ruleset(tmp_path)
    variant = (name.upper() if upper else name) + ("." if dot else "")
    a = decide(rs, "p", RequestFacts(host=name))
    b = decide(rs, "p", RequestFacts(host=variant))
    assert (a.allowed, a.reason, a.rule_id) == (b.allowed, b.reason, b.rule_id)
