"""Ports for services started on the fly never come from the kernel's source-port range,
where any outgoing connection could take them between the probe and the bind."""

from __future__ import annotations

import socket

from hypothesis import given
from hypothesis import strategies as st

from stockade import ports


def test_the_range_is_read_and_a_bad_file_falls_back() -> None:
    assert ports.ephemeral_range("32768\t60999\n") == (32768, 60999)
    assert ports.ephemeral_range("61000 1024") == (1024, 61000)
    assert ports.ephemeral_range("garbage") == (32768, 60999)


@given(st.integers(1024, 65535), st.integers(1024, 65535))
def test_candidates_lie_outside_the_range(a: int, b: int) -> None:
    lo, hi = min(a, b), max(a, b)
    ranges = ports.outside_ranges((lo, hi))
    if not ranges:
        assert lo <= ports.LOWEST and hi >= 65535
        return
    for _ in range(20):
        port = ports.candidate(ranges)
        assert ports.LOWEST <= port <= 65535
        assert not lo <= port <= hi


def test_free_ports_are_bindable_distinct_and_outside_this_hosts_range() -> None:
    lo, hi = ports.ephemeral_range()
    seen = [ports.free_port() for _ in range(50)] + [ports.free_dual_port("127.0.0.1")]
    assert len(set(seen)) == len(seen)
    for port in seen:
        assert not lo <= port <= hi
    with socket.socket() as s:
        s.bind(("127.0.0.1", seen[0]))


def test_a_block_is_free_outside_the_range() -> None:
    lo, hi = ports.ephemeral_range()
    base = ports.free_port_block(5)
    assert all(not lo <= p <= hi for p in range(base, base + 5))
    assert ports.free_port() not in range(base, base + 5)
