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
        (("/x",), "/x#frag", True),
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
        assert p is not None and p.rstrip("/").count("/") == 1


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
