from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.gateway.sniff_common import NEED_MORE, SniffError
from stockade.gateway.sniff_http import (
    AuthorityError,
    HttpSniffer,
    RequestHead,
    parse_authority,
)
from stockade.policy.reasons import Reason


def sniff(data: bytes, max_bytes: int = 16384) -> object:
    return HttpSniffer(max_bytes).feed(data)


def test_origin_form_with_host() -> None:
    r = sniff(b"GET /simple/ HTTP/1.1\r\nHost: pypi.test\r\nAccept: */*\r\n\r\nbody")
    assert isinstance(r, RequestHead)
    assert (r.method, r.form, r.path, r.host_header) == ("GET", "origin", "/simple/", "pypi.test")
    assert r.head_len == len(b"GET /simple/ HTTP/1.1\r\nHost: pypi.test\r\nAccept: */*\r\n\r\n")


def test_absolute_form() -> None:
    r = sniff(b"GET http://Allowed.test:8080/a?b=1 HTTP/1.1\r\nHost: allowed.test:8080\r\n\r\n")
    assert isinstance(r, RequestHead) and r.form == "absolute"
    assert r.authority is not None
    assert (r.authority.host, r.authority.port, r.path) == ("Allowed.test", 8080, "/a?b=1")


def test_absolute_form_without_path() -> None:
    r = sniff(b"GET http://allowed.test HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    assert isinstance(r, RequestHead) and r.path == "/" and r.authority is not None
    assert r.authority.port is None


def test_connect_authority_form() -> None:
    r = sniff(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
    assert isinstance(r, RequestHead) and r.form == "authority" and r.authority is not None
    assert (r.authority.host, r.authority.port) == ("allowed.test", 443)


def test_connect_ipv6_literal() -> None:
    r = sniff(b"CONNECT [fd00:ec2::254]:443 HTTP/1.1\r\n\r\n")
    assert isinstance(r, RequestHead) and r.authority is not None
    assert r.authority.is_ip and r.authority.host == "fd00:ec2::254"


def test_duplicate_host_is_an_error() -> None:
    r = sniff(b"GET / HTTP/1.1\r\nHost: allowed.test\r\nhost: denied.test\r\n\r\n")
    assert isinstance(r, SniffError) and r.reason == Reason.DESTINATION_MISMATCH


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.1\r\nHost: allowed.test\r\n folded\r\n\r\n",  # obs-fold
        b"GET / HTTP/1.1\nHost: allowed.test\r\n\r\n",  # bare LF
        b"GET  / HTTP/1.1\r\n\r\n",  # double space
        b"GET / HTTP/2.0\r\n\r\n",
        b"get / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n",
        b"GET / HTTP/1.1\r\n: empty\r\n\r\n",
        b"POST allowed.test:80 HTTP/1.1\r\n\r\n",  # authority-form without CONNECT
    ],
)
def test_malformed_heads_are_errors(head: bytes) -> None:
    assert isinstance(sniff(head), SniffError)


@pytest.mark.parametrize(
    "head",
    [
        b"GET http://user@allowed.test/ HTTP/1.1\r\n\r\n",
        b"GET https://allowed.test/ HTTP/1.1\r\n\r\n",
        b"CONNECT allowed.test@evil.test:443 HTTP/1.1\r\n\r\n",
        b"CONNECT [allowed.test]:443 HTTP/1.1\r\n\r\n",
        b"CONNECT allowed.test:99999 HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a@b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: [allowed.test]\r\n\r\n",
    ],
)
def test_host_tricks_are_invalid_host(head: bytes) -> None:
    r = sniff(head)
    assert isinstance(r, SniffError) and r.reason == Reason.INVALID_HOST


def test_need_more_then_result() -> None:
    s = HttpSniffer()
    assert s.feed(b"GET / HTTP/1.1\r\nHo") is NEED_MORE
    assert s.feed(b"st: allowed.test\r\n\r") is NEED_MORE
    assert isinstance(s.feed(b"\n"), RequestHead)


def test_oversized_head() -> None:
    s = HttpSniffer(max_bytes=1024)
    assert s.feed(b"GET / HTTP/1.1\r\n") is NEED_MORE
    r = s.feed(b"X-Fill: " + b"a" * 2000)
    assert isinstance(r, SniffError) and r.reason == Reason.HEAD_TOO_LARGE


def test_not_http_is_refused_early() -> None:
    r = sniff(b"SSH-2.0-OpenSSH")
    assert isinstance(r, SniffError) and r.reason == Reason.PROTOCOL_UNRECOGNISED


@pytest.mark.parametrize(
    ("raw", "host", "port"),
    [
        ("a.test", "a.test", None),
        ("a.test:81", "a.test", 81),
        ("[::1]:5", "::1", 5),
        ("10.0.0.1", "10.0.0.1", None),
    ],
)
def test_parse_authority(raw: str, host: str, port: int | None) -> None:
    a = parse_authority(raw)
    assert (a.host, a.port) == (host, port)


@pytest.mark.parametrize("raw", ["", "a:b:c", "::1", "a.test:", "a.test:0", "a b", "a/b", "[::1"])
def test_parse_authority_rejects(raw: str) -> None:
    with pytest.raises(AuthorityError):
        parse_authority(raw)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    r = sniff(data, max_bytes=1024)
    assert r is NEED_MORE or isinstance(r, SniffError | RequestHead)


_line = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=40)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["GET", "CONNECT", "POST"]), _line, st.lists(_line, max_size=5))
def test_arbitrary_heads_never_crash(method: str, target: str, headers: list[str]) -> None:
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
    r = sniff(head.encode("latin-1"))
    assert r is NEED_MORE or isinstance(r, SniffError | RequestHead)
    if isinstance(r, RequestHead) and r.authority is not None:
        assert "@" not in r.authority.host


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=60))
def test_segmenting_does_not_change_result(step: int) -> None:
    head = b"GET http://allowed.test/x HTTP/1.1\r\nHost: allowed.test\r\nA: b\r\n\r\n"
    s = HttpSniffer()
    results = [s.feed(head[i : i + step]) for i in range(0, len(head), step)]
    assert results[-1] == sniff(head)


def test_force_close_rewrites_only_connection_headers() -> None:
    from stockade.gateway.sniff_http import force_close

    raw = (
        b"GET /a HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\n"
        b"Keep-Alive: timeout=5\r\nX-Other: 1\r\n\r\nbody-bytes"
    )
    h = sniff(raw)
    assert isinstance(h, RequestHead)
    out = force_close(h, raw)
    assert out == (
        b"GET /a HTTP/1.1\r\nHost: allowed.test\r\nX-Other: 1\r\n"
        b"Connection: close\r\n\r\nbody-bytes"
    )
    again = sniff(out)
    assert isinstance(again, RequestHead)
    assert again.host_header == "allowed.test"
