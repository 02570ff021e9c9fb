"""Table tests for the private helpers the sniffers and decide_flow are built from."""

from __future__ import annotations

import pytest
from stockade.gateway.flow import FlowDecision, _one_host, _reuse_prior
from stockade.gateway.sniff_common import SniffError
from stockade.gateway.sniff_http import (
    AuthorityError,
    RequestHead,
    _bare,
    _bracketed,
    _header_fields,
    _port,
    _request_line,
)
from stockade.gateway.sniff_tls import MAX_RECORD, _partial_header_error, _record_length
from stockade.policy.reasons import Reason


def assert_parsed(got: object, expected: object) -> None:
    """A str `expected` is the detail of the SniffError `got` must be; else `got` is it."""
    if isinstance(expected, str):
        assert isinstance(got, SniffError) and got.detail == expected
    else:
        assert got == expected


# --- sniff_http ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("[::1]", ("::1", None)), ("[::1]:443", ("::1", "443")), ("[::1]:", ("::1", ""))],
)
def test_bracketed(raw: str, expected: tuple[str, str | None]) -> None:
    assert _bracketed(raw) == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [("[::1", "unclosed"), ("[::1]x", "junk after"), ("[1.2.3.4]", "not an IPv6 literal")],
)
def test_bracketed_refuses(raw: str, message: str) -> None:
    with pytest.raises(AuthorityError, match=message):
        _bracketed(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("example.com", ("example.com", None, False)),
        ("example.com:8080", ("example.com", "8080", False)),
        ("10.0.0.1", ("10.0.0.1", None, True)),
        ("10.0.0.1:", ("10.0.0.1", "", True)),
    ],
)
def test_bare(raw: str, expected: tuple[str, str | None, bool]) -> None:
    assert _bare(raw) == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [("a:1:2", "extra colon"), ("a]:1", "extra colon"), (":80", "bad host"), ("a\"b", "bad host")],
)
def test_bare_refuses(raw: str, message: str) -> None:
    with pytest.raises(AuthorityError, match=message):
        _bare(raw)


@pytest.mark.parametrize(("text", "port"), [("1", 1), ("443", 443), ("65535", 65535)])
def test_port(text: str, port: int) -> None:
    assert _port(text) == port


@pytest.mark.parametrize("text", ["", "0", "65536", "123456", "-1", "8o"])
def test_port_refuses(text: str) -> None:
    with pytest.raises(AuthorityError, match="bad port"):
        _port(text)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"GET / HTTP/1.1", ("GET", "/", "HTTP/1.1")),
        (b"CONNECT a:443 HTTP/1.0", ("CONNECT", "a:443", "HTTP/1.0")),
        (b"GET /  HTTP/1.1", None),
        (b"get / HTTP/1.1", None),
        (b"GET / HTTP/2.0", None),
        (b"GET /", None),
    ],
)
def test_request_line(line: bytes, expected: tuple[str, str, str] | None) -> None:
    got = _request_line(line)
    if expected is None:
        assert isinstance(got, SniffError) and got.detail == "malformed request line"
    else:
        assert got == expected


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([], ()),
        ([b"Host: a", b"X-y:\t v \t"], (("Host", "a"), ("X-y", "v"))),
        ([b"Host:"], (("Host", ""),)),
        ([b"V: \xe9"], (("V", "\xe9"),)),
        ([b" folded: x"], "malformed header line"),
        ([b"no colon"], "malformed header line"),
        ([b": empty name"], "malformed header line"),
        ([b"A: b\x00c"], "control character in header"),
    ],
)
def test_header_fields(lines: list[bytes], expected: tuple | str) -> None:
    got = _header_fields(lines)
    assert_parsed(got, expected)


# --- sniff_tls -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hdr", "expected"),
    [
        (b"\x16\x03\x01\x00\x05", 5),
        (b"\x16\x03\x04" + MAX_RECORD.to_bytes(2, "big"), MAX_RECORD),
        (b"\x17\x03\x01\x00\x05", "not a TLS handshake record"),
        (b"\x16\x02\x01\x00\x05", "bad record version"),
        (b"\x16\x03\x05\x00\x05", "bad record version"),
        (b"\x16\x03\x01\x00\x00", "bad record length"),
        (b"\x16\x03\x01" + (MAX_RECORD + 1).to_bytes(2, "big"), "bad record length"),
    ],
)
def test_record_length(hdr: bytes, expected: int | str) -> None:
    got = _record_length(hdr)
    assert_parsed(got, expected)


@pytest.mark.parametrize(
    ("rest", "expected"),
    [
        (b"", None),
        (b"\x16", None),
        (b"\x16\x03\x01\x00", None),
        (b"\x17", "not a TLS handshake record"),
        (b"\x16\x02", "bad record version"),
    ],
)
def test_partial_header_error(rest: bytes, expected: str | None) -> None:
    got = _partial_header_error(rest)
    assert (got if got is None else got.detail) == expected


# --- flow ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("named", "expected"),
    [
        ([("SNI", "Example.COM.", None)], "example.com"),
        ([("CONNECT authority", "a.test", 443), ("SNI", "A.test", None)], "a.test"),
        ([("SNI", "a b", None)], (Reason.INVALID_HOST, "SNI: ")),
        ([("Host", "a.test", 80)], (Reason.DESTINATION_MISMATCH, "Host names port 80")),
        ([("SNI", "a.test", None), ("Host", "b.test", None)],
         (Reason.DESTINATION_MISMATCH, "SNI, Host name different hosts")),
    ],
)
def test_one_host(named: list, expected: str | tuple[Reason, str]) -> None:
    got = _one_host(named, "tls", 443, "v1")
    if isinstance(expected, str):
        assert got == expected
    else:
        assert isinstance(got, FlowDecision) and not got.allowed
        assert got.reason == expected[0] and got.detail.startswith(expected[1])
        assert got.port == 443 and got.policy_version == "v1" and got.protocol == "tls"


PRIOR = FlowDecision(True, Reason.ALLOWED_BY_RULE, "http", 443, host="a.test",
                     rule_id="r", policy_version="v1", detail="d")
HEAD = RequestHead("GET", "/", "HTTP/1.1", "origin", "a.test", None, "/", 20, ())


@pytest.mark.parametrize(
    ("prior", "head", "host", "port", "version", "reused"),
    [
        (PRIOR, None, "a.test", 443, "v1", True),
        (PRIOR, HEAD, "a.test", 443, "v1", True),
        (None, None, "a.test", 443, "v1", False),
        (PRIOR, None, "b.test", 443, "v1", False),
        (PRIOR, None, "a.test", 444, "v1", False),
        (PRIOR, None, "a.test", 443, "v2", False),
        (FlowDecision(True, Reason.ALLOWED_BY_RULE, "tcp", 443, ip="10.0.0.1",
                      policy_version="v1"), None, None, 443, "v1", False),
        (FlowDecision(False, Reason.INSPECTION_UNAVAILABLE, "http", 443, host="a.test",
                      policy_version="v1"), HEAD, "a.test", 443, "v1", False),
        (FlowDecision(False, Reason.INSPECTION_UNAVAILABLE, "http", 443, host="a.test",
                      policy_version="v1"), None, "a.test", 443, "v1", True),
    ],
)
def test_reuse_prior(prior, head, host, port, version, reused: bool) -> None:
    got = _reuse_prior(prior, head, host, "http", port, version)
    assert (got is not None) == reused
    if reused:
        assert got is prior


def test_reuse_prior_takes_the_flows_protocol() -> None:
    got = _reuse_prior(PRIOR, None, "a.test", "tls", 443, "v1")
    assert got is not None and got.protocol == "tls"
    assert got == FlowDecision(True, Reason.ALLOWED_BY_RULE, "tls", 443, host="a.test",
                               rule_id="r", policy_version="v1", detail="d")
