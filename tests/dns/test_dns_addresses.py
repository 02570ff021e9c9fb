"""The special-purpose address registry: table coverage, exemptions, embedded IPv4."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stockade.net.addresses import (
    METADATA_ADDRESSES,
    SPECIAL_PURPOSE,
    AddressPolicy,
    embedded_ipv4,
)

POLICY = AddressPolicy()
BLOCKS = [ipaddress.ip_network(n) for n, _ in SPECIAL_PURPOSE]


@pytest.mark.parametrize(
    ("ip", "category"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.255.254", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "cgnat"),
        ("100.127.255.255", "cgnat"),
        ("169.254.1.1", "link_local"),
        ("fe80::1", "link_local"),
        ("fe80::1%eth0", "link_local"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("ff02::1", "multicast"),
        ("192.0.2.1", "documentation"),
        ("198.51.100.7", "documentation"),
        ("203.0.113.9", "documentation"),
        ("2001:db8::1", "documentation"),
        ("3fff::1", "documentation"),
        ("198.18.0.1", "benchmarking"),
        ("198.19.255.255", "benchmarking"),
        ("2001:2::1", "benchmarking"),
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("::", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.254", "reserved"),
        ("255.255.255.255", "broadcast"),
        ("fc00::1", "unique_local"),
        ("fd12:3456::1", "unique_local"),
        ("fec0::1", "site_local"),
        ("100::1", "discard"),
        ("169.254.169.254", "metadata"),
        ("fd00:ec2::254", "metadata"),
        ("168.63.129.16", "metadata"),
        ("100.100.100.200", "metadata"),
        ("::ffff:127.0.0.1", "ipv4_embedded"),
        ("::ffff:8.8.8.8", "ipv4_embedded"),
        ("::ffff:0:8.8.8.8", "ipv4_embedded"),
        ("::8.8.8.8", "ipv4_embedded"),
        ("64:ff9b::8.8.8.8", "ipv4_embedded"),
        ("64:ff9b:1::a00:1", "ipv4_embedded"),
        ("2002:0808:0808::1", "ipv4_embedded"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "ipv4_embedded"),
        ("4000::1", "reserved"),  # outside 2000::/3
        ("192.0.0.9", "reserved"),
        ("192.88.99.1", "reserved"),
    ],
)
def test_forbidden_categories(ip: str, category: str) -> None:
    assert POLICY.check(ip) == category


@pytest.mark.parametrize(
    "ip", ["1.1.1.1", "8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450::1"]
)
def test_public_addresses_allowed(ip: str) -> None:
    assert POLICY.check(ip) is None
    assert POLICY.dialable(ip)


def test_input_forms() -> None:
    assert POLICY.check(ipaddress.ip_address("10.0.0.1")) == "private"
    assert POLICY.check(b"\x7f\x00\x00\x01") == "loopback"
    assert POLICY.check(b"8.8.8.8") is None
    assert POLICY.check(0x08080808) is None
    assert POLICY.check("[::1]") == "loopback"
    for bad in ("", "example.com", "1.2.3", "::g", -1, 2**129, b"\xff" * 5, None, True, 1.5):
        assert POLICY.check(bad) == "invalid"


def test_allow_exempts_ranges_but_not_metadata() -> None:
    p = AddressPolicy(allow=["10.250.0.0/24", "169.254.0.0/16", "fd00::/8"])
    assert p.check("10.250.0.5") is None
    assert p.check("10.250.1.5") == "private"
    assert p.check("169.254.1.1") is None
    assert p.check("169.254.169.254") == "metadata"
    assert p.check("fd00:ec2::254") == "metadata"
    exact = AddressPolicy(allow=["169.254.169.254/32", "fd00:ec2::254"])
    assert exact.check("169.254.169.254") is None
    assert exact.check("fd00:ec2::254") is None
    assert exact.check("168.63.129.16") == "metadata"


def test_own_addresses_never_exempt() -> None:
    p = AddressPolicy(allow=["127.0.0.0/8", "10.0.0.0/8"], own=["127.0.0.7", "10.9.0.0/16"])
    assert p.check("127.0.0.7") == "own_address"
    assert p.check("10.9.3.4") == "own_address"
    assert p.check("::ffff:127.0.0.7") == "own_address"
    assert p.check("127.0.0.8") is None


def test_exempted_translation_prefix_still_checks_embedded() -> None:
    p = AddressPolicy(allow=["64:ff9b::/96", "2002::/16", "2001::/32"])
    assert p.check("64:ff9b::8.8.8.8") is None
    assert p.check("64:ff9b::169.254.169.254") == "metadata"
    assert p.check("64:ff9b::7f00:1") == "loopback"
    assert p.check("2002:0a00:0001::1") == "private"
    assert p.check("2002:0808:0808::1") is None
    # Teredo: server 65.54.227.120, client obfuscated 192.168.0.1 -> forbidden
    teredo = ipaddress.IPv6Address(
        (0x20010000 << 96) | (0x4136E378 << 64) | (~0xC0A80001 & 0xFFFFFFFF)
    )
    assert p.check(teredo) == "private"


def test_embedded_extraction() -> None:
    assert embedded_ipv4(ipaddress.IPv6Address("::ffff:1.2.3.4")) == [
        ipaddress.IPv4Address("1.2.3.4")
    ]
    assert embedded_ipv4(ipaddress.IPv6Address("2002:102:304::")) == [
        ipaddress.IPv4Address("1.2.3.4")
    ]
    assert embedded_ipv4(ipaddress.IPv6Address("2606:4700::1")) == []


def test_every_metadata_address_forbidden() -> None:
    for ip in METADATA_ADDRESSES:
        assert POLICY.check(ip) == "metadata"


@st.composite
def block_member(draw: st.DrawFn) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    net = draw(st.sampled_from(BLOCKS))
    offset = draw(st.integers(0, net.num_addresses - 1))
    return net.network_address + offset


@given(block_member())
def test_every_block_member_forbidden(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    assert POLICY.check(addr) is not None
    assert POLICY.check(str(addr)) is not None
    assert POLICY.check(addr.packed) is not None


def _stdlib_special(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return (
        not addr.is_global
        or addr.is_multicast
        or addr.is_reserved
        or addr.is_link_local
        or addr.is_loopback
        or addr.is_private
    )


@given(st.integers(0, 2**32 - 1))
def test_ipv4_agrees_with_stdlib_and_table(value: int) -> None:
    addr = ipaddress.IPv4Address(value)
    result = POLICY.check(value)
    if _stdlib_special(addr):
        assert result is not None  # the stdlib oracle's special addresses are all forbidden
    if any(addr in b for b in BLOCKS):
        assert result is not None
    else:
        assert result is None  # random public addresses are allowed


@given(st.integers(0x2000 << 112, (0x4000 << 112) - 1))
def test_ipv6_global_unicast(value: int) -> None:
    addr = ipaddress.IPv6Address(value)
    result = POLICY.check(addr)
    if _stdlib_special(addr):
        assert result is not None
    if not any(addr in b for b in BLOCKS):
        assert result is None


@given(st.one_of(st.integers(), st.binary(max_size=40), st.text(max_size=60)))
def test_never_crashes(value: object) -> None:
    result = POLICY.check(value)
    assert result is None or isinstance(result, str)
