"""Host normalisation: one canonical form, or HostError (requests then fail closed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.policy import HostError, normalize_host, normalize_pattern, split_host_port
from stockade.policy.hosts import is_ip_literal


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("Example.COM", "example.com"),
        ("example.com.", "example.com"),
        ("EXAMPLE.com.", "example.com"),
        ("B\u00fccher.example", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        # fullwidth letters map (UTS-46)
        ("\uff25\uff38\uff21\uff2d\uff30\uff2c\uff25.com", "example.com"),
        ("ex\u3002ample.com", "ex.ample.com"),  # ideographic full stop is a dot
        ("_acme-challenge.example.com", "_acme-challenge.example.com"),
        ("127.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
        ("2001:DB8:0:0::1", "2001:db8::1"),
        ("::ffff:127.0.0.1", "::ffff:7f00:1"),
        ("a" * 63 + ".com", "a" * 63 + ".com"),
    ],
)
def test_normalises(raw, want):
    assert normalize_host(raw) == want


@pytest.mark.parametrize(
    "raw",
    [
        "",
        ".",
        "[::1]",
        "[example.com]",
        "user@example.com",
        "example.com@evil.com",
        "exa mple.com",
        "example.com\n",
        "\texample.com",
        "exa\x00mple.com",
        "exa\x7fmple.com",
        "example..com",
        ".example.com",
        "example.com..",
        "*.example.com",
        "ex*ample.com",
        "a" * 64 + ".com",
        ("a" * 60 + ".") * 5 + "com",
        "example.com:443",
        "fe80::1%eth0",
        "127.1",
        "0x7f.0.0.1",
        "2130706433",
        "1.2.3.256",
        "-example.com",
        "example-.com",
        "exa/mple.com",
        "exa\\mple.com",
        "example.com#frag",
        "example.com?q",
        "%65xample.com",
        "xn--zz.com",
        "exam\u200bple.com",  # zero-width space
        "\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45\uff20evil.com",  # fullwidth '@' maps to '@'
        "x" * 2000,
    ],
)
def test_refuses(raw):
    with pytest.raises(HostError):
        normalize_host(raw)


def test_host_error_is_value_error_and_non_strings_refused():
    assert issubclass(HostError, ValueError)
    with pytest.raises(HostError):
        normalize_host(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "want"),
    [("*.Example.COM.", "*.example.com"), ("*.b\u00fccher.example", "*.xn--bcher-kva.example")],
)
def test_patterns(raw, want):
    assert normalize_pattern(raw) == want


@pytest.mark.parametrize(
    "raw", ["*", "*.com", "a.*.com", "**.com", "*a.com", "1.2.3.4", "*.1.2.3.4"]
)
def test_bad_patterns(raw):
    with pytest.raises(HostError):
        normalize_pattern(raw)


@pytest.mark.parametrize(
    ("authority", "want"),
    [
        ("example.com", ("example.com", 443)),
        ("example.com:8443", ("example.com", 8443)),
        ("[::1]:8443", ("::1", 8443)),
        ("[::1]", ("::1", 443)),
        ("::1", ("::1", 443)),
        ("user@example.com:80", ("user@example.com", 80)),
    ],
)
def test_split_host_port(authority, want):
    assert split_host_port(authority, 443) == want


@pytest.mark.parametrize(
    "authority", ["[example.com]:443", "[::1", "a:b", "a:0", "a:70000", "[::1]x"]
)
def test_split_host_port_refuses(authority):
    with pytest.raises(HostError):
        split_host_port(authority, 443)


# -- properties ------------------------------------------------------------------------

hosty = st.text(
    alphabet=st.sampled_from(list("abcXYZ019-_.*@[]: \t\x00%/\u00fc\u3002\uff21\u00df\u03a3")),
    max_size=80,
)


@settings(max_examples=600, deadline=None)
@given(st.one_of(hosty, st.text(max_size=300)))
def test_normalisation_is_idempotent_or_refuses(raw):
    try:
        once = normalize_host(raw)
    except HostError:
        return
    assert normalize_host(once) == once
    assert once == once.lower() and not once.endswith(".")
    assert once.isascii()
    assert not any(c in once for c in "[]@ \t/\\%") and len(once) <= 253
    if not is_ip_literal(once):
        assert all(0 < len(label) <= 63 for label in once.split("."))


labels = st.from_regex(r"[a-z0-9](?:[a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(labels, min_size=2, max_size=5), st.booleans(), st.booleans())
def test_case_and_trailing_dot_do_not_change_identity(parts, upper, dot):
    name = ".".join(parts)
    if is_ip_literal_like(name):
        return
    variant = (name.upper() if upper else name) + ("." if dot else "")
    assert normalize_host(variant) == normalize_host(name)


def is_ip_literal_like(name: str) -> bool:
    return name.rpartition(".")[2].isdigit() or name.rpartition(".")[2].startswith("0x")
