"""Table tests for the private helpers decide() and normalize_host() are built from."""

from __future__ import annotations

import ipaddress

import pytest
from stockade.policy import Reason, RequestFacts, Verdict
from stockade.policy.decide import _destination
from stockade.policy.hosts import HostError, _check_shape, _ip6_literal

PROFILE = """
profile: p
egress:
  allow:
    - host: pypi.org
      reason: index
"""


@pytest.mark.parametrize(
    ("host", "ip", "expected"),
    [
        ("pypi.org", None, ("pypi.org", None)),
        ("PyPI.org.", None, ("pypi.org", None)),
        ("pypi.org", "10.0.0.1", ("pypi.org", ipaddress.ip_address("10.0.0.1"))),
        (None, "10.0.0.1", (None, ipaddress.ip_address("10.0.0.1"))),
        ("10.0.0.1", "10.0.0.1", (None, ipaddress.ip_address("10.0.0.1"))),
        ("10.0.0.1", "10.0.0.2", Reason.DESTINATION_MISMATCH),
        ("bad host", None, Reason.INVALID_HOST),
        (None, "not-an-ip", Reason.INVALID_HOST),
        (None, None, Reason.INVALID_HOST),
    ],
)
def test_destination(load_profile, host, ip, expected) -> None:
    cp = load_profile(PROFILE).compiled["p"]
    got = _destination(cp, RequestFacts(host=host, port=443, ip=ip))
    if isinstance(expected, Reason):
        assert isinstance(got, Verdict) and not got.allowed and got.reason == expected
    else:
        assert got == expected


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "empty host"),
        ("a" * 254, "longer than 253"),
        ("a..b", "empty label"),
        (".a", "empty label"),
        ("-a.b", "start or end with '-'"),
        ("a-.b", "start or end with '-'"),
        ("a.-b", "start or end with '-'"),
        ("b" * 64 + ".c", "label longer than 63"),
    ],
)
def test_check_shape_refuses(name: str, message: str) -> None:
    with pytest.raises(HostError, match=message):
        _check_shape(name)


@pytest.mark.parametrize("name", ["a", "a.b", "x" * 63 + ".c", "a-b.c_d", "0x7f.example"])
def test_check_shape_accepts(name: str) -> None:
    _check_shape(name)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("::1", "::1"), ("0:0:0:0:0:0:0:1", "::1"), ("2001:DB8::1", "2001:db8::1")],
)
def test_ip6_literal(raw: str, expected: str) -> None:
    assert _ip6_literal(raw) == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [("[::1]", "forbidden character"), ("::1%eth0", "forbidden character"),
     ("a:b", "not an IP address"), ("example.com:443", "not an IP address")],
)
def test_ip6_literal_refuses(raw: str, message: str) -> None:
    with pytest.raises(HostError, match=message):
        _ip6_literal(raw)
