from __future__ import annotations

from pathlib import Path

import pytest
from gw_rules import write_rules
from gw_tlsgen import hello_with_sni, real_client_hello
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stockade.gateway.flow import FlowInput, decide_flow
from stockade.gateway.sniff_common import NEED_MORE, SniffError
from stockade.gateway.sniff_http import HttpSniffer, RequestHead
from stockade.gateway.sniff_tls import ClientHello, TlsSniffer
from stockade.policy import RuleSet, load_rules
from stockade.policy.reasons import Reason


@pytest.fixture(scope="module")
def rules(tmp_path_factory: pytest.TempPathFactory) -> RuleSet:
    return load_rules(write_rules(tmp_path_factory.mktemp("rules")))


def tls(name: str | None) -> ClientHello:
    r = TlsSniffer().feed(real_client_hello(name) if name else real_client_hello(None))
    assert isinstance(r, ClientHello)
    return r


def synth(*names: str, ech: bool = False) -> ClientHello | SniffError:
    r = TlsSniffer().feed(hello_with_sni(*names, ech=ech))
    assert r is not NEED_MORE
    return r  # type: ignore[return-value]


def head(raw: bytes) -> RequestHead:
    r = HttpSniffer().feed(raw)
    assert isinstance(r, RequestHead), r
    return r


def transparent(rules: RuleSet, port: int = 443, ip: str = "10.250.0.9", **kw: object):
    return decide_flow(FlowInput("transparent", ip, port, **kw), rules, "web")  # type: ignore[arg-type]


def test_allowed_sni(rules: RuleSet) -> None:
    d = transparent(rules, tls=tls("allowed.test"))
    assert d.allowed and d.host == "allowed.test" and d.port == 443 and d.ip is None
    assert d.rule_id and d.policy_version == rules.version


def test_original_ip_is_never_the_destination_of_a_named_flow(rules: RuleSet) -> None:
    d = transparent(rules, ip="169.254.169.254", tls=tls("allowed.test"))
    assert d.allowed and d.ip is None and d.host == "allowed.test"


# a TLS flow refused on its ClientHello: (port, the hello's maker, the reason)
TLS_DENIALS = {
    "unlisted_sni_denied": (443, lambda: tls("denied.test"), Reason.NO_MATCHING_RULE),
    "deny_entry_wins": (443, lambda: tls("bad.wild.test"), Reason.DENIED_BY_RULE),
    "port_not_allowed": (8443, lambda: tls("allowed.test"), Reason.PORT_NOT_ALLOWED),
    "missing_sni": (443, lambda: tls(None), Reason.SNI_MISSING),
    "ech_denied": (443, lambda: synth("allowed.test", ech=True), Reason.ECH_PRESENT),
    "ip_literal_sni_without_cidr": (443, lambda: synth("93.184.216.34"),
                                    Reason.NO_MATCHING_RULE),
}


@pytest.mark.parametrize("case", list(TLS_DENIALS))
def test_tls_flow_denied(rules: RuleSet, case: str) -> None:
    port, hello, reason = TLS_DENIALS[case]
    d = transparent(rules, port=port, tls=hello())
    assert not d.allowed and d.reason == reason


@pytest.mark.parametrize("name", ["ALLOWED.test", "allowed.test."])
def test_case_and_trailing_dot_normalise(rules: RuleSet, name: str) -> None:
    d = transparent(rules, tls=synth(name))
    assert d.allowed and d.host == "allowed.test"


def test_idn_names(rules: RuleSet) -> None:
    d = transparent(rules, tls=synth("XN--BCHER-KVA.test"))
    assert d.allowed and d.host == "xn--bcher-kva.test"
    # raw UTF-8 in a Host header is refused (clients send A-labels), never "decoded"
    r = HttpSniffer().feed("GET / HTTP/1.1\r\nHost: bücher.test\r\n\r\n".encode())
    assert isinstance(r, SniffError) and r.reason == Reason.INVALID_HOST
    d = transparent(rules, sniff_error=r)
    assert not d.allowed


def test_two_snis(rules: RuleSet) -> None:
    r = synth("allowed.test", "denied.test")
    assert isinstance(r, SniffError)
    d = transparent(rules, sniff_error=r)
    assert not d.allowed and d.reason == Reason.SNI_MISSING


def test_ip_literal_with_cidr_rule(rules: RuleSet) -> None:
    d = transparent(rules, port=5432, tls=synth("10.250.0.7"))
    assert d.allowed and d.ip == "10.250.0.7" and d.host is None


def test_raw_tcp_by_cidr(rules: RuleSet) -> None:
    err = SniffError(Reason.PROTOCOL_UNRECOGNISED, "x")
    d = transparent(rules, port=5432, ip="10.250.0.7", sniff_error=err)
    assert d.allowed and d.protocol == "tcp" and d.ip == "10.250.0.7"
    d = transparent(rules, port=5433, ip="10.250.0.7", sniff_error=err)
    assert not d.allowed and d.reason == Reason.PROTOCOL_UNRECOGNISED


def test_host_mismatch_in_plain_http(rules: RuleSet) -> None:
    d = transparent(
        rules, port=80, http=head(b"GET http://allowed.test/ HTTP/1.1\r\nHost: denied.test\r\n\r\n")
    )
    assert not d.allowed and d.reason == Reason.DESTINATION_MISMATCH


def test_host_port_confusion(rules: RuleSet) -> None:
    d = transparent(rules, port=80, http=head(b"GET / HTTP/1.1\r\nHost: allowed.test:8080\r\n\r\n"))
    assert not d.allowed and d.reason == Reason.DESTINATION_MISMATCH


def test_userinfo_host(rules: RuleSet) -> None:
    r = HttpSniffer().feed(b"GET / HTTP/1.1\r\nHost: allowed.test@denied.test\r\n\r\n")
    assert isinstance(r, SniffError)
    d = transparent(rules, port=80, sniff_error=r)
    assert not d.allowed and d.reason == Reason.INVALID_HOST


def test_plain_http_without_host(rules: RuleSet) -> None:
    d = transparent(rules, port=80, http=head(b"GET / HTTP/1.0\r\n\r\n"))
    assert not d.allowed and d.reason == Reason.SNI_MISSING


def test_proxy_connect_pre_decision(rules: RuleSet) -> None:
    c = head(b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n")
    assert decide_flow(FlowInput("proxy", connect=c), rules, "web").allowed
    c = head(b"CONNECT 10.250.0.9:443 HTTP/1.1\r\n\r\n")
    d = decide_flow(FlowInput("proxy", connect=c), rules, "web")
    assert not d.allowed


def test_connect_authority_vs_sni(rules: RuleSet) -> None:
    c = head(b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n")
    d = decide_flow(FlowInput("proxy", connect=c, tls=tls("denied.test")), rules, "web")
    assert not d.allowed and d.reason == Reason.DESTINATION_MISMATCH
    d = decide_flow(FlowInput("proxy", connect=c, tls=tls("allowed.test")), rules, "web")
    assert d.allowed and d.port == 443


def test_absolute_uri_fronting(rules: RuleSet) -> None:
    h = head(b"GET http://denied.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    d = decide_flow(FlowInput("proxy", http=h), rules, "web")
    assert not d.allowed and d.reason == Reason.DESTINATION_MISMATCH
    h = head(b"GET http://allowed.test/x HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    d = decide_flow(FlowInput("proxy", http=h), rules, "web")
    assert d.allowed and d.port == 80


def test_inspection_unavailable(rules: RuleSet) -> None:
    d = transparent(rules, tls=tls("inspect.test"))
    assert not d.allowed and d.reason == Reason.INSPECTION_UNAVAILABLE


def test_host_must_match_sni_sends_tls_to_the_inspector_and_decides_plain_http(
    rules: RuleSet,
) -> None:
    """TLS of a `host_must_match_sni` entry needs the inspector (transparent and through a
    CONNECT); plain HTTP is decided on its one request head, any method and path, and a
    Host naming another host than the CONNECT authority is a mismatch as for any entry."""
    d = transparent(rules, tls=tls("front.test"))
    assert not d.allowed and d.reason == Reason.INSPECTION_UNAVAILABLE and d.host == "front.test"
    connect = head(b"CONNECT front.test:443 HTTP/1.1\r\n\r\n")
    pre = decide_flow(FlowInput("proxy", connect=connect), rules, "web")
    assert pre.reason == Reason.INSPECTION_UNAVAILABLE
    inner = FlowInput("proxy", connect=connect, tls=tls("front.test"))
    assert decide_flow(inner, rules, "web", prior=pre).reason == Reason.INSPECTION_UNAVAILABLE
    for line in (b"DELETE /any/path", b"POST /upload"):
        raw = line + b" HTTP/1.1\r\nHost: front.test\r\nContent-Length: 0\r\n\r\n"
        d = transparent(rules, http=head(raw), port=80)
        assert d.allowed and d.reason == Reason.ALLOWED_BY_RULE and d.protocol == "http"
    mismatch = head(b"GET / HTTP/1.1\r\nHost: x.test\r\n\r\n")
    other = FlowInput("proxy", connect=connect, http=mismatch)
    assert decide_flow(other, rules, "web", prior=pre).reason == Reason.DESTINATION_MISMATCH


def test_plain_http_is_decided_on_its_method_and_path(rules: RuleSet) -> None:
    """An entry with an `http:` block decides plain HTTP on the (only) request head."""
    get = head(b"GET /x HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
    d = transparent(rules, http=get)
    assert d.allowed and d.reason == Reason.ALLOWED_BY_RULE and d.protocol == "http"
    post = head(b"POST /x HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
    d = transparent(rules, http=post)
    assert not d.allowed and d.reason == Reason.METHOD_NOT_ALLOWED
    # through a CONNECT, the authority's "needs inspection" verdict is not reused for it
    connect = head(b"CONNECT inspect.test:443 HTTP/1.1\r\n\r\n")
    pre = decide_flow(FlowInput("proxy", connect=connect), rules, "web")
    assert pre.reason == Reason.INSPECTION_UNAVAILABLE
    inner = FlowInput("proxy", connect=connect, http=post)
    assert decide_flow(inner, rules, "web", prior=pre).reason == Reason.METHOD_NOT_ALLOWED
    inner = FlowInput("proxy", connect=connect, http=get)
    assert decide_flow(inner, rules, "web", prior=pre).allowed


def test_report_mode(rules: RuleSet) -> None:
    d = decide_flow(
        FlowInput("transparent", "10.250.0.9", 443, tls=tls("denied.test")), rules, "watch"
    )
    assert d.allowed and d.report_only and d.reason == Reason.NO_MATCHING_RULE
    assert d.host == "denied.test"


def test_unknown_profile(rules: RuleSet) -> None:
    d = decide_flow(
        FlowInput("transparent", "10.250.0.9", 443, tls=tls("allowed.test")), rules, "nope"
    )
    assert not d.allowed and d.reason == Reason.UNKNOWN_PROFILE


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=1024), port=st.sampled_from([80, 443, 8080]))
def test_arbitrary_bytes_never_allowed(rules: RuleSet, data: bytes, port: int) -> None:
    """Whatever the sniffers make of random bytes, the flow decision never allows it."""
    for sniffer in (TlsSniffer(), HttpSniffer()):
        r = sniffer.feed(data)
        if r is NEED_MORE:
            r = SniffError(Reason.SNIFF_TIMEOUT, "deadline")
        kw: dict[str, object] = {}
        if isinstance(r, SniffError):
            kw["sniff_error"] = r
        elif isinstance(r, ClientHello):
            kw["tls"] = r
        else:
            kw["http"] = r
        d = decide_flow(FlowInput("transparent", "10.250.0.9", port, **kw), rules, "web")  # type: ignore[arg-type]
        assert not d.allowed


def test_rules_dir_is_real(tmp_path: Path) -> None:
    rs = load_rules(write_rules(tmp_path))
    assert set(rs.profiles) == {"web", "watch", "tiny"}
