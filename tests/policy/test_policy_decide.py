"""decide / decide_name / match_operation on real loaded rule sets."""

from __future__ import annotations

from datetime import date

from stockade.policy import (
    BrokerGrant,
    BrokerOperation,
    Reason,
    RequestFacts,
    decide,
    decide_name,
    match_operation,
)

BASE = """
profile: p
egress:
  allow:
    - host: pypi.org
      reason: index
    - host: "*.example.org"
      ports: [443, 8443]
      reason: example subdomains
    - cidr: 10.1.0.0/16
      ports: [5432]
      reason: db
    - host: registry.test
      reason: reads only
      http: {methods: [GET, HEAD], paths: ["/simple/*", "/pkg/**"]}
    - host: old.example.net
      reason: temporary
      expires: 2026-01-31
  deny:
    - host: bad.example.org
      reason: known bad
    - cidr: 10.1.2.0/24
      reason: admin subnet
"""


def facts(host: str | None = None, port: int = 443, **kw: object) -> RequestFacts:
    return RequestFacts(host=host, port=port, **kw)  # type: ignore[arg-type]


def test_exact_allow_carries_rule_and_version(load_profile):
    rs = load_profile(BASE)
    v = decide(rs, "p", facts("pypi.org"))
    assert v.allowed and v.reason == Reason.ALLOWED_BY_RULE
    assert v.rule_id == "p:allow:pypi.org"
    assert v.entry_reason == "index"
    assert v.policy_version == rs.version and len(rs.version) == 16
    assert not v.report_only and not v.needs_inspection


def test_name_tricks_normalised_or_refused(load_profile):
    rs = load_profile(BASE)
    assert decide(rs, "p", facts("PyPI.ORG.")).allowed
    assert decide(rs, "p", facts("[pypi.org]")).reason == Reason.INVALID_HOST
    assert decide(rs, "p", facts("user@pypi.org")).reason == Reason.INVALID_HOST
    assert decide(rs, "p", facts("pypi.org@evil.com")).reason == Reason.INVALID_HOST
    assert decide(rs, "p", facts("pypi.org\x00.evil")).reason == Reason.INVALID_HOST
    assert decide(rs, "p", facts("pypi..org")).reason == Reason.INVALID_HOST
    assert decide(rs, "p", facts("[::1]")).reason == Reason.INVALID_HOST
    assert not decide(rs, "p", facts("pypi.org.evil.com")).allowed
    assert not decide(rs, "p", facts("evilpypi.org")).allowed


def test_wildcard_does_not_match_apex(load_profile):
    rs = load_profile(BASE)
    assert decide(rs, "p", facts("a.example.org")).allowed
    assert decide(rs, "p", facts("a.b.example.org", 8443)).allowed
    v = decide(rs, "p", facts("example.org"))
    assert not v.allowed and v.reason == Reason.NO_MATCHING_RULE and v.rule_id is None


def test_deny_overrides_allow_on_every_port(load_profile):
    rs = load_profile(BASE)
    for port in (443, 8443, 80):
        v = decide(rs, "p", facts("bad.example.org", port))
        assert not v.allowed and v.reason == Reason.DENIED_BY_RULE
        assert v.rule_id == "p:deny:bad.example.org" and v.entry_reason == "known bad"


def test_ports(load_profile):
    rs = load_profile(BASE)
    v = decide(rs, "p", facts("pypi.org", 80))
    assert v.reason == Reason.PORT_NOT_ALLOWED and v.rule_id == "p:allow:pypi.org"
    assert decide(rs, "p", facts("pypi.org", 0)).reason == Reason.PORT_NOT_ALLOWED
    assert decide(rs, "p", facts("pypi.org", 70000)).reason == Reason.PORT_NOT_ALLOWED


def test_cidr_allow_and_deny(load_profile):
    rs = load_profile(BASE)
    assert decide(rs, "p", facts(ip="10.1.9.9", port=5432)).allowed
    assert decide(rs, "p", facts("10.1.9.9", port=5432)).allowed
    assert decide(rs, "p", facts(ip="10.1.2.3", port=5432)).reason == Reason.DENIED_BY_RULE
    assert decide(rs, "p", facts(ip="10.2.0.1", port=5432)).reason == Reason.NO_MATCHING_RULE
    assert decide(rs, "p", facts(ip="10.1.9.9", port=22)).reason == Reason.PORT_NOT_ALLOWED
    mismatch = decide(rs, "p", facts("10.1.9.9", port=5432, ip="10.1.9.8"))
    assert mismatch.reason == Reason.DESTINATION_MISMATCH
    assert decide(rs, "p", facts(ip="not-an-ip", port=5432)).reason == Reason.INVALID_HOST
    assert decide(rs, "p", facts()).reason == Reason.INVALID_HOST


def test_ip_literal_never_matches_name_rule(load_profile):
    rs = load_profile(BASE)
    assert decide(rs, "p", facts("127.0.0.1")).reason == Reason.NO_MATCHING_RULE
    assert decide(rs, "p", facts("::1")).reason == Reason.NO_MATCHING_RULE
    assert decide(rs, "p", facts("127.1")).reason == Reason.INVALID_HOST


def test_http_block_needs_inspection(load_profile):
    rs = load_profile(BASE)
    v = decide(rs, "p", facts("registry.test"))
    assert not v.allowed and v.reason == Reason.INSPECTION_UNAVAILABLE and v.needs_inspection
    assert v.rule_id == "p:allow:registry.test"
    ok = decide(rs, "p", facts("registry.test", method="get", path="/simple/requests/"))
    assert ok.allowed and ok.needs_inspection
    assert decide(rs, "p", facts("registry.test", method="HEAD", path="/pkg/a/b/c.whl")).allowed
    post = decide(rs, "p", facts("registry.test", method="POST", path="/simple/x/"))
    assert post.reason == Reason.METHOD_NOT_ALLOWED and not post.allowed
    path = decide(rs, "p", facts("registry.test", method="GET", path="/upload/x"))
    assert path.reason == Reason.PATH_NOT_ALLOWED
    # '*' stays in one segment; dot segments and encoded slashes never match
    for bad in ("/simple/a/b", "/simple/../upload", "/pkg/%2e%2e/x", "/simple/a%2Fb"):
        v = decide(rs, "p", facts("registry.test", method="GET", path=bad))
        assert v.reason == Reason.PATH_NOT_ALLOWED, bad


def test_expiry(load_profile):
    rs = load_profile(BASE)
    assert decide(rs, "p", facts("old.example.net"), today=date(2026, 1, 31)).allowed
    v = decide(rs, "p", facts("old.example.net"), today=date(2026, 2, 1))
    assert v.reason == Reason.NO_MATCHING_RULE
    assert decide_name(rs, "p", "old.example.net", today=date(2026, 2, 1)).allowed is False


def test_report_mode_turns_policy_denials_into_flagged_allows(load_profile):
    rs = load_profile(BASE.replace("egress:\n", "egress:\n  mode: report\n"))
    v = decide(rs, "p", facts("nowhere.test"))
    assert v.allowed and v.report_only and v.reason == Reason.NO_MATCHING_RULE
    v = decide(rs, "p", facts("bad.example.org"))
    assert v.allowed and v.report_only and v.reason == Reason.DENIED_BY_RULE
    ok = decide(rs, "p", facts("pypi.org"))
    assert ok.allowed and not ok.report_only
    bad = decide(rs, "p", facts("a@b"))
    assert not bad.allowed and bad.reason == Reason.INVALID_HOST


def test_unknown_profile(load_profile):
    rs = load_profile(BASE)
    v = decide(rs, "nope", facts("pypi.org"))
    assert not v.allowed and v.reason == Reason.UNKNOWN_PROFILE
    assert decide_name(rs, "nope", "pypi.org").reason == Reason.UNKNOWN_PROFILE


def test_decide_name(load_profile):
    rs = load_profile(BASE)
    assert decide_name(rs, "p", "PYPI.org.").allowed
    assert decide_name(rs, "p", "x.example.org").rule_id == "p:allow:*.example.org"
    assert decide_name(rs, "p", "registry.test").allowed  # http rules still need the name
    assert decide_name(rs, "p", "bad.example.org").reason == Reason.DENIED_BY_RULE
    assert decide_name(rs, "p", "example.org").reason == Reason.NO_MATCHING_RULE
    assert decide_name(rs, "p", "a b.org").reason == Reason.INVALID_HOST


def test_port_limited_deny_keeps_name_resolvable(load_profile):
    rs = load_profile(
        """
        profile: p
        egress:
          allow: [{host: a.test, ports: [443, 80], reason: r}]
          deny: [{host: a.test, ports: [80], reason: no plain http}]
        """
    )
    assert decide_name(rs, "p", "a.test").allowed
    assert decide(rs, "p", facts("a.test", 80)).reason == Reason.DENIED_BY_RULE
    assert decide(rs, "p", facts("a.test", 443)).allowed


def test_presets_expand_with_their_own_ids(load_profile):
    rs = load_profile(
        """
        profile: p
        egress:
          presets: [reg]
        """,
        presets={
            "reg": """
            preset: reg
            allow: [{host: reg.test, reason: r}]
            deny: [{host: upload.reg.test, reason: no uploads}]
            """
        },
    )
    v = decide(rs, "p", facts("reg.test"))
    assert v.allowed and v.rule_id == "reg:allow:reg.test"
    assert rs.profiles["p"].allow[0].origin == "preset:reg"
    assert decide(rs, "p", facts("upload.reg.test")).reason == Reason.DENIED_BY_RULE


def test_most_specific_entry_wins(load_profile):
    rs = load_profile(
        """
        profile: p
        egress:
          allow:
            - {host: "*.z.test", reason: broad, id: broad}
            - {host: "*.a.z.test", reason: narrower, id: narrow}
            - {host: x.a.z.test, reason: exact, id: exact}
        """
    )
    assert decide(rs, "p", facts("x.a.z.test")).rule_id == "exact"
    assert decide(rs, "p", facts("y.a.z.test")).rule_id == "narrow"
    assert decide(rs, "p", facts("a.z.test")).rule_id == "broad"


def test_match_operation():
    grant = BrokerGrant(
        api="github",
        operations=(
            BrokerOperation("GET", "/repos/*/*/issues"),
            BrokerOperation("*", "/rate_limit"),
        ),
    )
    assert match_operation(grant, "get", "/repos/o/r/issues")
    assert match_operation(grant, "GET", "/repos/o/r/issues?state=open")
    assert not match_operation(grant, "POST", "/repos/o/r/issues")
    assert not match_operation(grant, "GET", "/repos/o/r/x/issues")
    assert not match_operation(grant, "GET", "/repos/o/r/../../user/issues")
    assert not match_operation(grant, "GET", "/repos/o%2fx/r/issues")
    assert match_operation(grant, "DELETE", "/rate_limit")
    assert not match_operation(grant, "GET", "rate_limit")


def test_idn_rules_and_requests_meet_in_punycode(load_profile):
    rs = load_profile(
        """
        profile: p
        egress:
          allow:
            - {host: "bücher.example", reason: idn exact}
            - {host: "*.xn--mnchen-3ya.example", reason: idn wildcard}
        """
    )
    assert rs.profiles["p"].allow[0].host == "xn--bcher-kva.example"
    assert decide(rs, "p", facts("xn--bcher-kva.example")).allowed
    assert decide(rs, "p", facts("BÜCHER.example.")).allowed
    assert decide(rs, "p", facts("a.münchen.example")).allowed
    assert not decide(rs, "p", facts("münchen.example")).allowed  # apex
    assert not decide(rs, "p", facts("bucher.example")).allowed


def test_malformed_port_is_denied_even_in_report_mode(load_profile):
    rs = load_profile(BASE.replace("egress:\n", "egress:\n  mode: report\n"))
    for port in (0, -1, 65536):
        v = decide(rs, "p", facts("pypi.org", port))
        assert not v.allowed and not v.report_only and v.reason == Reason.PORT_NOT_ALLOWED
