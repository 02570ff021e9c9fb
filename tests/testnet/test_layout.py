"""Address plan and free-subnet choice (pure)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stockade.testing.testnet.layout import pick_client_block, pick_subnet, plan


def test_default_plan_matches_documented_addresses() -> None:
    lay = plan()
    assert lay.subnet == "10.250.0.0/24"
    assert (lay.host_ip, lay.ns_ip, lay.dns_server) == ("10.250.0.1", "10.250.0.2", "10.250.0.53")
    assert lay.addresses == {
        "allowed.test": "10.250.0.10",
        "denied.test": "10.250.0.11",
        "echo.test": "10.250.0.12",
        "pypi.test": "10.250.0.13",
        "api.test": "10.250.0.14",
        "other.test": "10.250.0.15",
        "git.test": "10.250.0.16",
    }
    assert lay.raw_echo_ip == "10.250.0.20"
    assert ipaddress.IPv6Address(lay.ipv6_address) in ipaddress.IPv6Network(lay.ipv6_prefix)
    assert ipaddress.IPv6Address(lay.ipv6_address).is_private  # a ULA


def test_plan_rejects_too_small_subnet() -> None:
    with pytest.raises(ValueError):
        plan("10.250.0.0/27")


def test_taken_subnet_moves_to_next_free_one() -> None:
    used = [ipaddress.ip_network("10.250.0.0/24"), ipaddress.ip_network("10.250.1.128/25")]
    assert pick_subnet("10.250.0.0/24", used) == "10.250.2.0/24"


def test_default_route_does_not_count_as_taken() -> None:
    assert pick_subnet("10.250.0.0/24", [ipaddress.ip_network("0.0.0.0/0")]) == "10.250.0.0/24"


def test_ipv6_prefix_collision_also_moves() -> None:
    used = [ipaddress.ip_network(plan("10.250.0.0/24").ipv6_prefix)]
    assert pick_subnet("10.250.0.0/24", used) == "10.250.1.0/24"


@given(st.sets(st.integers(0, 255), max_size=40))
def test_picked_subnet_never_overlaps_used(taken: set[int]) -> None:
    used = [ipaddress.ip_network(f"10.250.{i}.0/24") for i in taken]
    chosen = ipaddress.ip_network(pick_subnet("10.250.0.0/24", used))
    assert not any(chosen.overlaps(u) for u in used)


@given(st.sets(st.integers(0, 200), max_size=40))
def test_client_block_never_overlaps_used(taken: set[int]) -> None:
    used = [ipaddress.ip_network(f"10.251.0.{i * 4 % 256}/30") for i in taken]
    block = pick_client_block(used)
    assert block.prefixlen == 30
    assert block.subnet_of(ipaddress.ip_network("10.251.0.0/16"))
    assert not any(block.overlaps(u) for u in used)
