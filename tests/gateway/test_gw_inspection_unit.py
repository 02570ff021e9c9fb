"""The pure pieces of L7 inspection: the signed hand-off metadata and the per-request
decision (gateway/inspector/handoff.py, requests.py), the inspector's rule-set cache, the
CA files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.gateway.inspector.addon import RulesByVersion, inner_request
from stockade.gateway.inspector.handoff import (
    FLOW_HEADER,
    FlowMeta,
    MetaError,
    connect_request,
    decode_meta,
    encode_meta,
)
from stockade.gateway.inspector.requests import InnerRequest, decide_request
from stockade.gateway.inspector.supervisor import next_delay
from stockade.gateway.settings import InspectionSettings
from stockade.policy import load_rules
from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from stockade.trust import ensure_ca, trust_bundle, trust_env

KEY = b"k" * 32

PROFILE = """\
profile: l7
description: unit
egress:
  allow:
    - host: pypi.org
      id: pypi-index
      reason: index
      http: {methods: [GET, HEAD], paths: ["/simple/**", "/pypi/**"]}
    - host: files.pythonhosted.org
      reason: files, uninspected
"""
REPORT = (
    PROFILE.replace("profile: l7", "profile: l7r")
    .replace("egress:\n", "egress:\n  mode: report\n")
    .replace("id: pypi-index", "id: pypi-index-r")
)


@pytest.fixture(scope="module")
def rules(tmp_path_factory: pytest.TempPathFactory) -> RuleSet:
    root = tmp_path_factory.mktemp("rules")
    (root / "profiles").mkdir()
    (root / "profiles" / "l7.yaml").write_text(PROFILE)
    (root / "profiles" / "l7r.yaml").write_text(REPORT)
    return load_rules(root)


def meta(rules: RuleSet | None = None, **kw: object) -> FlowMeta:
    base: dict[str, object] = {
        "connection_id": 7,
        "task_id": "t-1",
        "profile": "l7",
        "host": "pypi.org",
        "ip": "151.101.0.223",
        "port": 443,
        "policy_version": rules.version if rules else "0123456789abcdef",
        "source_ip": "10.251.0.2",
        "source_port": 40000,
    }
    base.update(kw)
    return FlowMeta(**base)  # type: ignore[arg-type]


# -- hand-off metadata -------------------------------------------------------------------------


def test_round_trip_and_the_connect_request() -> None:
    m = meta(task_id="tâche 1 / ü", ip="2001:db8::1")
    assert decode_meta(encode_meta(m, KEY), KEY) == m
    req = connect_request(m, KEY)
    lines = req.split(b"\r\n")
    assert lines[0] == b"CONNECT [2001:db8::1]:443 HTTP/1.1"
    assert req.endswith(b"\r\n\r\n") and len(lines) == 5
    assert lines[2].startswith(FLOW_HEADER.encode() + b": ")


@pytest.mark.parametrize(
    "bad",
    [
        {"task_id": "t\r\nX-Evil: 1"},
        {"task_id": ""},
        {"task_id": "x" * 129},
        {"profile": "Web\r\n"},
        {"profile": "a b"},
        {"host": "PyPI.org"},  # not normalised
        {"host": "10.0.0.1"},  # an address is never the flow's name
        {"host": "a\r\nb.org"},
        {"ip": "pypi.org"},
        {"ip": "010.0.0.1"},
        {"ip": "::ffff:0:1.2.3.4"},
        {"port": 0},
        {"port": 70000},
        {"port": True},
        {"policy_version": "v1\r\n"},
        {"connection_id": -1},
        {"listener": "other"},
    ],
)
def test_hostile_values_are_refused_before_they_reach_a_header(bad: dict[str, object]) -> None:
    with pytest.raises(MetaError):
        encode_meta(meta(**bad), KEY)


def test_signature_key_and_shape_are_checked() -> None:
    good = encode_meta(meta(), KEY)
    with pytest.raises(MetaError):
        decode_meta(good, b"another key")
    payload, _, sig = good.partition(".")
    forged = encode_meta(meta(task_id="t-other"), b"attacker").partition(".")[0]
    for value in (payload, f"{forged}.{sig}", good + "x", good.replace(".", ".="), "", "a.b"):
        with pytest.raises(MetaError):
            decode_meta(value, KEY)


@settings(max_examples=300, deadline=None)
@given(
    task=st.text(min_size=0, max_size=140),
    profile=st.text(max_size=70),
    host=st.text(max_size=60),
)
def test_no_value_can_add_a_header_or_a_line(task: str, profile: str, host: str) -> None:
    """Whatever text a task id, profile or host holds: either it is refused, or the hand-off
    is exactly one request line and two headers, and decodes to the same values."""
    m = meta(task_id=task, profile=profile, host=host)
    try:
        req = connect_request(m, KEY)
    except MetaError:
        return
    head = req.decode("ascii")
    assert head.endswith("\r\n\r\n")
    lines = head[:-4].split("\r\n")
    assert len(lines) == 3 and "\n" not in "".join(lines) and "\r" not in "".join(lines)
    value = lines[2].split(": ", 1)[1]
    assert decode_meta(value, KEY) == m


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_header_values_never_decode(value: str) -> None:
    with pytest.raises(MetaError):
        decode_meta(value, KEY)


# -- the per-request decision ------------------------------------------------------------------


def req(method: str = "GET", path: str = "/simple/x/", *hosts: str, **kw: bool) -> InnerRequest:
    return InnerRequest(method, path, hosts or ("pypi.org",), **kw)


def test_allowed_and_denied_requests(rules: RuleSet) -> None:
    m = meta(rules)
    ok = decide_request(rules, m, req())
    assert ok.allowed and ok.reason == Reason.ALLOWED_BY_RULE and ok.rule_id == "pypi-index"
    assert decide_request(rules, m, req("HEAD", "/pypi/x/json", "PyPI.org.:443")).allowed
    post = decide_request(rules, m, req("POST", "/simple/x/"))
    assert not post.allowed and post.reason == Reason.METHOD_NOT_ALLOWED
    assert post.rule_id == "pypi-index"
    other = decide_request(rules, m, req("GET", "/legacy/"))
    assert not other.allowed and other.reason == Reason.PATH_NOT_ALLOWED
    dots = decide_request(rules, m, req("GET", "/simple/../legacy/"))
    assert not dots.allowed


@pytest.mark.parametrize(
    "hosts",
    [
        ("files.pythonhosted.org",),  # allowed elsewhere without inspection: still fronting
        ("pypi.org", "evil.test"),
        ("pypi.org:8443",),
        ("pypi.org@evil.test",),
        ("[::1]",),
        ("",),
    ],
)
def test_another_host_inside_tls_is_refused(rules: RuleSet, hosts: tuple[str, ...]) -> None:
    d = decide_request(rules, meta(rules), req("GET", "/simple/", *hosts))
    assert not d.allowed and d.reason == Reason.DESTINATION_MISMATCH


def test_no_host_connect_and_upgrade_are_refused(rules: RuleSet) -> None:
    m = meta(rules)
    no_host = decide_request(rules, m, InnerRequest("GET", "/simple/", ()))
    assert no_host.reason == Reason.DESTINATION_MISMATCH
    assert decide_request(rules, m, req("CONNECT", "")).reason == Reason.PROTOCOL_UNRECOGNISED
    up = decide_request(rules, m, req("GET", "/simple/", upgrade=True))
    assert not up.allowed and up.reason == Reason.PROTOCOL_UNRECOGNISED


def test_another_rule_set_version_is_never_decided_on(rules: RuleSet) -> None:
    d = decide_request(rules, meta(rules, policy_version="ffffffffffffffff"), req())
    assert not d.allowed and d.reason == Reason.INSPECTION_UNAVAILABLE


def test_report_mode_lets_policy_denials_through_but_not_fronting(rules: RuleSet) -> None:
    m = meta(rules, profile="l7r")
    d = decide_request(rules, m, req("POST", "/upload"))
    assert d.allowed and d.report_only and d.reason == Reason.METHOD_NOT_ALLOWED
    front = decide_request(rules, m, req("GET", "/simple/", "evil.test"))
    assert not front.allowed and not front.report_only


@settings(max_examples=300, deadline=None)
@given(
    method=st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "get", "PATCH"]),
    path=st.text(max_size=40),
    host=st.text(max_size=30),
)
def test_decide_request_only_allows_what_the_entry_allows(
    rules: RuleSet, method: str, path: str, host: str
) -> None:
    d = decide_request(rules, meta(rules), InnerRequest(method, path, (host,)))
    if d.allowed:
        assert method.upper() in ("GET", "HEAD")
        assert path.startswith(("/simple/", "/pypi/")) or path in ("/simple", "/pypi")
        assert host.lower().rstrip(".").split(":")[0] == "pypi.org"


def test_inner_request_collects_every_name() -> None:
    from mitmproxy.test import tutils

    r = tutils.treq(authority=b"pypi.org:443", headers=((b"host", b"a.test"), (b"host", b"b")))
    ir = inner_request(r)
    assert ir.authorities == ("a.test", "b", "pypi.org:443") and not ir.upgrade
    r.headers["upgrade"] = "websocket"
    assert inner_request(r).upgrade


# -- rule versions, settings, CA -----------------------------------------------------------------


def test_rules_by_version_keeps_recent_versions_and_never_guesses(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    f = tmp_path / "profiles" / "l7.yaml"
    f.write_text(PROFILE)
    cache = RulesByVersion(str(tmp_path))
    first = cache.load()
    assert first is not None and cache.get(first.version) is first
    f.write_text(PROFILE.replace("reason: index", "reason: index (changed)"))
    second = cache.load()
    assert second is not None and second.version != first.version
    assert cache.get(first.version) is first  # a flow decided just before the change
    assert cache.get("0000000000000000") is None
    f.write_text("profile: [broken")
    assert cache.load() is None and cache.get(second.version) is second


def test_listen_must_be_loopback() -> None:
    assert InspectionSettings(listen="127.0.0.2:9").listen == "127.0.0.2:9"
    for bad in ("0.0.0.0:1", "10.0.0.1:1", "[::]:1"):
        with pytest.raises(ValueError):
            InspectionSettings(listen=bad)


def test_ca_is_made_once_with_a_private_key(tmp_path: Path) -> None:
    d = tmp_path / "ca"
    cert = ensure_ca(d)
    pem = cert.read_bytes()
    assert b"BEGIN CERTIFICATE" in pem and b"PRIVATE KEY" not in pem
    for key in d.glob("mitmproxy-ca.*"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert ensure_ca(d) == cert and cert.read_bytes() == pem


def test_ca_dir_is_made_private_and_an_existing_one_is_never_loosened(tmp_path: Path) -> None:
    made = tmp_path / "new" / "ca"
    ensure_ca(made)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    existing = tmp_path / "operator-ca"
    existing.mkdir(mode=0o750)
    os.chmod(existing, 0o750)  # noqa: S103 - an operator's choice, kept as it is
    ensure_ca(existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o750


def test_restart_delay_backs_off_in_a_crash_loop() -> None:
    s = InspectionSettings(restart_delay_s=0.5, restart_delay_max_s=10.0, stable_after_s=30.0)
    d, seen = 0.0, []
    for _ in range(7):  # each child crashes 1 s after ready
        d = next_delay(d, 1.0, s)
        seen.append(d)
    assert seen == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert next_delay(10.0, 0.0, s) == 10.0  # never ready: still backing off
    assert next_delay(10.0, 31.0, s) == 0.5  # was up long enough: start over


def test_trust_bundle_holds_the_public_cas_and_the_inspection_ca(tmp_path: Path) -> None:
    cert = ensure_ca(tmp_path / "ca")
    system = tmp_path / "system.pem"
    system.write_bytes(b"-----BEGIN CERTIFICATE-----\npublic\n-----END CERTIFICATE-----")
    bundle = trust_bundle(cert, str(system))
    assert bundle.startswith(system.read_bytes() + b"\n") and bundle.endswith(cert.read_bytes())
    assert b"PRIVATE KEY" not in trust_bundle(cert)  # the host's real bundle
    env = trust_env("/etc/stockade-ca-bundle.pem")
    assert set(env) == {"SSL_CERT_FILE", "PIP_CERT", "NODE_EXTRA_CA_CERTS"}
    # these override a CA a tool was given explicitly (requests ignores verify=<file>)
    assert not set(env) & {"REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO"}
    assert set(env.values()) == {"/etc/stockade-ca-bundle.pem"}
