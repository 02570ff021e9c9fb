"""Sizes/durations/rates, path globs and TARGET parsing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.policy.globs import GlobError, compile_glob, path_matches, request_path
from stockade.policy.targets import TargetError, parse_target
from stockade.policy.units import parse_duration, parse_rate, parse_size


@pytest.mark.parametrize(
    ("raw", "want"),
    [(0, 0), (1024, 1024), ("512MiB", 512 * 2**20), ("1GiB", 2**30), ("100MB", 10**8),
     ("10 KiB", 10240), ("1.5KiB", 1536), ("7b", 7), ("42", 42)],
)  # fmt: skip
def test_sizes(raw, want):
    assert parse_size(raw) == want


@pytest.mark.parametrize("raw", [-1, True, 1.5, "1.2B", "lots", "5 parsecs", "MiB", None, "1e3"])
def test_bad_sizes(raw):
    with pytest.raises(ValueError):
        parse_size(raw)


@pytest.mark.parametrize(
    ("raw", "want"), [(300, 300), ("300s", 300), ("5m", 300), ("1h", 3600), ("1d", 86400)]
)
def test_durations(raw, want):
    assert parse_duration(raw) == want


@pytest.mark.parametrize("raw", ["5 minutes", "1w", -3, "0.5s", False])
def test_bad_durations(raw):
    with pytest.raises(ValueError):
        parse_duration(raw)


def test_rates():
    assert parse_rate("10/s") == 10
    assert parse_rate("120/min") == 2
    assert parse_rate("3600/h") == 1
    for bad in ("10", 10, "0/s", "10/day", "ten/s"):
        with pytest.raises(ValueError):
            parse_rate(bad)


@pytest.mark.parametrize(
    ("globs", "path", "ok"),
    [
        (("/simple/*",), "/simple/requests/", True),  # trailing slash is optional
        (("/simple/*",), "/simple/requests", True),
        (("/simple/*",), "/simple/a/b", False),  # '*' stays in one segment
        (("/simple/**",), "/simple/a/b/", True),
        (("/a/?",), "/a/b", True),
        (("/a/?",), "/a/bc", False),
        (("/a.b",), "/aXb", False),  # regex characters are literal
        (("/x",), "/x?query=1", True),
        (("/x",), "/x#frag", False),  # a fragment is never part of a request target
        (("/**",), "/a/../b", False),
        (("/**",), "/a/./b", False),
        (("/**",), "/a//b", False),
        (("/**",), "/a/%2e%2e/b", False),
        (("/**",), "/a%2Fb", False),
        (("/**",), "/a%5cb", False),
        (("/**",), "/a\\b", False),
        (("/**",), "relative", False),
        (("/**",), "/a b", False),
        (("/**",), "/ok/\x00", False),
    ],
)
def test_path_globs(globs, path, ok):
    assert path_matches(globs, path) is ok


# the 2026-11 review's escapes: each reaches /upload on some server
REVIEW_ESCAPES = [
    "/simple/..;/upload",
    "/simple/#/../../upload",
    "/simple/%252e%252e/upload",
    "/simple/..%3B/upload",
    "/simple/..%3b/upload",
    "/simple/%c0%ae%c0%ae/upload",
    "/simple/%C1%9C/upload",
    "/simple/%u002e%u002e/upload",
    "/simple/\u2025/upload",
    "/simple/x;jsessionid=1",
    "/simple/%2e%2e/upload",
    "/simple/%/upload",
    "/simple/%zz/upload",
    "/simple/%00/upload",
    "/simple/\x7f/upload",
]


@pytest.mark.parametrize("path", REVIEW_ESCAPES)
def test_ambiguous_paths_never_match(path):
    assert request_path(path) is None
    assert not path_matches(("/simple/**",), path)


@pytest.mark.parametrize(
    "path", ["/simple/requests/", "/simple/requests", "/simple/a%2Bb/", "/simple/x/?q=1",
             "/pypi/x/json", "/packages/ab/cd/requests-2.0-py3-none-any.whl"],
)  # fmt: skip
def test_registry_paths_still_match(path):
    assert path_matches(("/simple/**", "/pypi/*/json", "/packages/**"), path)


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4."""
    out: list[str] = []
    for seg in path.split("/")[1:]:
        if seg == "..":
            if out:
                out.pop()
        elif seg != ".":
            out.append(seg)
    if path.split("/")[-1] in (".", ".."):
        out.append("")
    return "/" + "/".join(out)


_TRICKY = st.text(alphabet="/.;%#?\\aAb2345cCeEfF0u\u2025 \x00+", max_size=40)


@settings(max_examples=1500, deadline=None)
@given(_TRICKY, st.sampled_from(["/a/**", "/a/*", "/a/*/b", "/a/**/b"]))
def test_an_allowed_path_stays_under_the_globs_prefix_after_decoding(tail, glob):
    """Whatever an upstream does with it (one percent-decoding, then dot-segment
    removal), an allowed path stays under the glob's literal prefix and has no ';'."""
    from urllib.parse import unquote

    path = "/a/" + tail
    if not path_matches((glob,), path):
        return
    p = request_path(path)
    assert p is not None
    for view in (p, unquote(p, errors="strict"), _remove_dot_segments(unquote(p))):
        norm = _remove_dot_segments(view)
        assert norm.startswith("/a/") or norm == "/a", (path, view, norm)
        assert ";" not in view and "\\" not in view, (path, view)
    assert unquote(p) == unquote(unquote(p)), path  # decoding twice changes nothing


def test_bad_globs():
    for bad in ("simple/*", "", "/a b", "/a\x01"):
        with pytest.raises(GlobError):
            compile_glob(bad)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=60), st.sampled_from(["/*", "/a/*", "/**", "/a/**/b", "/?"]))
def test_globs_never_crash_and_star_never_crosses_slash(path, glob):
    result = path_matches((glob,), path)
    p = request_path(path)
    if result:
        assert p is not None
    if glob == "/*" and result:
        # one segment, possibly empty ("/" itself) or with a trailing slash ("/a/")
        assert p is not None and len(p.strip("/").split("/")) == 1


@pytest.mark.parametrize(
    ("target", "method", "want"),
    [
        ("https://pypi.org/simple/x/", None, ("pypi.org", 443, "GET", "/simple/x/")),
        ("http://pypi.org", None, ("pypi.org", 80, "GET", "/")),
        ("https://pypi.org:8443/a?b=c", "post", ("pypi.org", 8443, "POST", "/a?b=c")),
        ("https://[::1]:8443/", None, ("::1", 8443, "GET", "/")),
        ("https://user@pypi.org/", None, ("user@pypi.org", 443, "GET", "/")),
        ("https://a@b@pypi.org/", None, ("a@b@pypi.org", 443, "GET", "/")),
        ("https://[pypi.org]/", None, ("[pypi.org]", 443, "GET", "/")),
        ("pypi.org:443", None, ("pypi.org", 443, None, None)),
        ("pypi.org", None, ("pypi.org", 443, None, None)),
        ("pypi.org:80", "HEAD", ("pypi.org", 80, "HEAD", "/")),
        ("10.0.0.1:5432", None, ("10.0.0.1", 5432, None, None)),
        ("[::1]:22", None, ("::1", 22, None, None)),
    ],
)
def test_targets(target, method, want):
    f = parse_target(target, method)
    assert (f.host, f.port, f.method, f.path) == want


def test_bad_target_scheme():
    with pytest.raises(TargetError):
        parse_target("ftp://a.test/")
