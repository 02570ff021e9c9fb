"""The connection shares of the DNS firewall's TCP listener (pure, fuzzed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from stockade.gateway.dns.shares import Shares


def test_per_key_and_global_caps() -> None:
    s = Shares(total=4, per_key=2)
    assert [s.acquire("a") for _ in range(3)] == [None, None, "per_source"]
    assert s.acquire("b") is None and s.acquire("b") is None
    assert s.acquire("c") == "global"
    s.release("a")
    assert s.acquire("c") is None
    assert s.held == {"a": 1, "b": 2, "c": 1} and s.count == 4


def test_release_without_a_share_is_refused() -> None:
    s = Shares(2, 1)
    with pytest.raises(ValueError):
        s.release("a")
    with pytest.raises(ValueError):
        Shares(0, 1)


@given(st.integers(1, 8), st.integers(1, 8),
       st.lists(st.tuples(st.booleans(), st.sampled_from("abcd")), max_size=200))
def test_caps_always_hold(total: int, per_key: int, ops: list[tuple[bool, str]]) -> None:
    s = Shares(total, per_key)
    for take, key in ops:
        if take:
            s.acquire(key)
        elif s.held.get(key):
            s.release(key)
        assert s.count == sum(s.held.values()) <= total
        assert all(0 < n <= per_key for n in s.held.values())
