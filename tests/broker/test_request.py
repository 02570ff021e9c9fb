"""Request validation and URL building: the caller can never move the call off the API host."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.broker.request import (
    RequestError,
    build_url,
    check_path,
    filter_headers,
    filter_response_headers,
    normalize_query,
    parse_base_url,
    parse_query,
    rewrite_links,
)
from stockade.policy.model import ApiDefinition, CredentialSource, Injection

API = ApiDefinition(
    name="gh",
    base_url="https://api.example.test:8443/v3",
    credential=CredentialSource("secret", "stockade/gh", "token"),
    injection=Injection("header", header="X-Api-Key", template="Token {secret}"),
)


@pytest.mark.parametrize(
    "path",
    [
        "/../etc/passwd", "/a/../../b", "/a/%2e%2e/b", "/a/%2E%2e/b", "/a/.%2e/b", "/./a",
        "/a%2fb", "/a%2Fb", "/a%5cb", "/a\\b", "//evil.test/x", "http://evil.test/x",
        "evil.test/x", "/a\r\nHost: evil", "/a%0d%0aX: y", "/a%00", "/a b", "/a?x=1", "/a#f",
        "/a%zz", "/a%2", "/" + "a" * 9000,
    ],
)
def test_bad_paths_are_refused(path: str) -> None:
    with pytest.raises(RequestError):
        check_path(path)


@pytest.mark.parametrize(
    ("path", "decoded"),
    [("/repos/a/b/issues", "/repos/a/b/issues"), ("/q/a%20b", "/q/a b"), ("/", "/"),
     ("/x/..foo", "/x/..foo"), ("/x/%C3%A4", "/x/ä")],
)
def test_good_paths(path: str, decoded: str) -> None:
    assert check_path(path) == (path, decoded)


def test_build_url_keeps_host_port_and_prefix() -> None:
    up = parse_base_url(API)
    url = build_url(up, "/repos/a", normalize_query({"q": "x y&z=1"}))
    assert url == "https://api.example.test:8443/v3/repos/a?q=x%20y%26z%3D1"
    # a pass-through query is kept verbatim: "+" still means what the SDK meant
    url = build_url(up, "/search", parse_query("q=foo+bar&x=%2B1"))
    assert url == "https://api.example.test:8443/v3/search?q=foo+bar&x=%2B1"


def test_plain_http_needs_opt_in() -> None:
    plain = ApiDefinition("p", "http://127.0.0.1:9/", API.credential, API.injection)
    with pytest.raises(RequestError):
        parse_base_url(plain)
    ok = ApiDefinition("p", "http://127.0.0.1:9/", API.credential, API.injection,
                       allow_plain_http=True)
    assert parse_base_url(ok).port == 9


def test_credential_host_and_hop_headers_dropped() -> None:
    got = filter_headers(
        [("Host", "evil.test"), ("Authorization", "Bearer mine"), ("X-Api-Key", "k"),
         ("x-api-key", "k2"), ("Cookie", "a=b"), ("Connection", "X-Drop"), ("X-Drop", "1"),
         ("Proxy-Authorization", "p"), ("Transfer-Encoding", "chunked"), ("Accept", "*/*"),
         ("X-Stockade-Task", "t"), ("Content-Type", "application/json"),
         ("Range", "bytes=10-19"), ("If-Range", '"e"')],
        API.injection,
    )
    assert got == (("Accept", "*/*"), ("Content-Type", "application/json"))


@pytest.mark.parametrize(
    ("name", "value"),
    [("X-A", "a\r\nHost: evil"), ("X-A", "a\nb"), ("X-A", "a\x00"), ("X A", "v"),
     ("X-A\r\nHost", "v"), ("", "v"),
     # a trailing newline slipped past a "$"-anchored token match
     ("X-A\n", "v"), ("X-Api-Key\n", "v")],
)
def test_crlf_nul_in_headers_refused(name: str, value: str) -> None:
    with pytest.raises(RequestError):
        filter_headers([(name, value)])


def test_response_headers_filtered() -> None:
    got = filter_response_headers(
        [("Content-Type", "text/plain"), ("Content-Length", "5"), ("Set-Cookie", "s=1"),
         ("Connection", "close"), ("Content-Encoding", "gzip"), ("X-Ok", "1")]
    )
    assert got == [("Content-Type", "text/plain"), ("X-Ok", "1")]


def test_query_forms() -> None:
    assert normalize_query({"a": "1", "b": ["2", 3], "c": True, "d e": "/"}) == (
        "a=1", "b=2", "b=3", "c=true", "d%20e=%2F")
    assert normalize_query([["a", "1"]]) == ("a=1",)
    assert parse_query("a=1&b=x%20y&&c") == ("a=1", "b=x%20y", "c")
    for bad in ("a=1#f", "a=%zz", "a=b c", "a=\r\n"):
        with pytest.raises(RequestError):
            parse_query(bad)
    with pytest.raises(RequestError):
        normalize_query("a=1")
    with pytest.raises(RequestError):
        normalize_query({"a": {"x": 1}})
    with pytest.raises(RequestError):
        normalize_query({"a": "x\r\ny"})


@settings(max_examples=500, deadline=None)
@given(
    path=st.text(alphabet=st.sampled_from(list("/.%2fFeE5cC0aAdD\\:@?#ab \r\n")), max_size=40),
    q=st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=3),
    raw_q=st.text(alphabet=st.sampled_from(list("ab=&%2fF#?/+ \r\n")), max_size=20),
)
def test_property_accepted_path_stays_on_host(
    path: str, q: list[tuple[str, str]], raw_q: str
) -> None:
    try:
        enc, dec = check_path(path)
        query = normalize_query(q) + parse_query(raw_q)
    except RequestError:
        return
    assert "\\" not in dec and "\r" not in dec and "\n" not in dec
    assert all(seg not in (".", "..") for seg in dec.split("/"))
    assert "%2f" not in enc.lower() and "%5c" not in enc.lower()
    assert unquote(enc) == dec
    url = build_url(parse_base_url(API), enc, query)
    parts = urlsplit(url)
    assert (parts.scheme, parts.hostname, parts.port) == ("https", "api.example.test", 8443)
    assert parts.path.startswith("/v3/")
    assert parts.fragment == ""


def test_rewrite_links_points_back_at_the_broker() -> None:
    got = rewrite_links(
        [("Location", "https://api.example.test:8443/v3/next?page=2"),
         ("Link", '<https://api.example.test:8443/v3/items?page=2>; rel="next", '
                  '<https://api.example.test:8443/v3>; rel="first"'),
         ("Location", "https://api.example.test:8443/v3evil/x"),
         ("X-Other", "https://api.example.test:8443/v3/kept")],
        API.base_url, "http://10.0.0.1:8081/gh",
    )
    assert got == [
        ("Location", "http://10.0.0.1:8081/gh/next?page=2"),
        ("Link", '<http://10.0.0.1:8081/gh/items?page=2>; rel="next", '
                 '<http://10.0.0.1:8081/gh>; rel="first"'),
        ("Location", "https://api.example.test:8443/v3evil/x"),
        ("X-Other", "https://api.example.test:8443/v3/kept"),
    ]


@settings(max_examples=1000, deadline=None)
@given(path=st.text(alphabet=st.sampled_from(list("/.%2fFe:@?#ab~!$&'()*+,;=-_ \\\r")),
                    max_size=30))
def test_property_plain_path_fast_path_agrees_with_full_check(path: str) -> None:
    """`check_path` answers plain paths without the escape/quote work; same answer."""
    from stockade.broker.request import _check_path_slow

    raw = path or "/"
    try:
        want: tuple[str, str] | None = _check_path_slow(raw)
    except RequestError:
        want = None
    try:
        got: tuple[str, str] | None = check_path(path)
    except RequestError:
        got = None
    assert got == want


@settings(max_examples=500, deadline=None)
@given(headers=st.lists(st.tuples(st.text(alphabet="aB-:\r\n x", max_size=6),
                                  st.text(alphabet="ab,\r\n\x00 \t", max_size=6)),
                        max_size=4))
def test_property_header_check_refuses_what_each_header_check_refuses(
    headers: list[tuple[str, str]],
) -> None:
    """The one-pass check over all headers refuses exactly when some header is bad."""
    from stockade.broker.request import check_header

    bad = False
    for n, v in headers:
        try:
            check_header(n, v)
        except RequestError:
            bad = True
    try:
        filter_headers(headers)
        refused = False
    except RequestError:
        refused = True
    assert refused == bad
