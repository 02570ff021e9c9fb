"""The shared resolver against a real (dnslib) upstream on loopback."""

from __future__ import annotations

import asyncio
import ipaddress
import time

import pytest
from dns_upstream import Upstream, free_udp_port

from stockade.net.addresses import AddressPolicy
from stockade.net.resolver import Resolver, normalize_name, parse_server


def make(up: Upstream, **kw: object) -> Resolver:
    return Resolver([up.server], AddressPolicy(), **kw)  # type: ignore[arg-type]


def test_parse_server() -> None:
    assert parse_server("10.0.0.1") == ("10.0.0.1", 53)
    assert parse_server("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_server("[::1]:5353") == ("::1", 5353)
    assert parse_server("::1") == ("::1", 53)
    assert normalize_name("WWW.Example.COM.") == "www.example.com"


async def test_a_and_aaaa(upstream: Upstream) -> None:
    r = make(upstream)
    res = await r.resolve("Allowed.Test.")
    assert res.error is None
    assert res.name == "allowed.test"
    assert set(res.addresses) == {"93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"}
    assert res.cnames == ()
    assert res.forbidden == ()
    assert res.ttl == 60
    assert upstream.queries("allowed.test", "A") == 1
    assert upstream.queries("allowed.test", "AAAA") == 1


async def test_cname_chain_recorded(upstream: Upstream) -> None:
    res = await make(upstream).resolve("alias.allowed.test")
    assert res.cnames == ("mid.allowed.test", "allowed.test")
    assert "93.184.216.34" in res.addresses


async def test_forbidden_addresses_removed(upstream: Upstream) -> None:
    r = make(upstream)
    res = await r.resolve("private.allowed.test")
    assert res.addresses == ("93.184.216.40",)
    assert res.forbidden == (("10.0.0.1", "private"),)
    meta = await r.resolve("metadata.allowed.test")
    assert meta.addresses == ()
    assert dict(meta.forbidden) == {
        "169.254.169.254": "metadata",
        "fd00:ec2::254": "metadata",
        str(ipaddress.ip_address("::ffff:127.0.0.1")): "ipv4_embedded",
    }
    allowed_private = Resolver([upstream.server], AddressPolicy(allow=["10.0.0.0/8"]))
    res2 = await allowed_private.resolve("private.allowed.test")
    assert set(res2.addresses) == {"10.0.0.1", "93.184.216.40"}


async def test_ttl_zero_is_cached_for_ttl_min(upstream: Upstream) -> None:
    r = make(upstream, ttl_min=7, ttl_max=300)
    first = await r.resolve("rebind.allowed.test")
    assert first.ttl == 7
    upstream.zone.a["rebind.allowed.test"] = ["10.0.0.9"]  # the rebinding step
    second = await r.resolve("rebind.allowed.test")
    assert second is first  # the same checked set until the clamped TTL lapses
    assert upstream.queries("rebind.allowed.test", "A") == 1
    assert r.hits == 1 and r.misses == 1
    # once the entry lapses (simulated clock), the cache no longer serves it
    assert r.cached("rebind.allowed.test", now=time.monotonic() + 8) is None
    third = await r.resolve("rebind.allowed.test")
    assert third.addresses == ()
    assert third.forbidden == (("10.0.0.9", "private"),)


async def test_ttl_max_clamp(upstream: Upstream) -> None:
    res = await make(upstream, ttl_max=120).resolve("long-ttl.allowed.test")
    assert res.ttl == 120
    assert 0 < res.remaining_ttl() <= 120


async def test_single_flight(upstream: Upstream) -> None:
    r = make(upstream)
    results = await asyncio.gather(*(r.resolve("www.allowed.test") for _ in range(25)))
    assert all(x is results[0] for x in results)
    assert upstream.queries("www.allowed.test", "A") == 1
    assert upstream.queries("www.allowed.test", "AAAA") == 1
    assert r.misses == 1


async def test_negative_caching(upstream: Upstream) -> None:
    r = make(upstream, ttl_min=5)
    a = await r.resolve("nope.allowed.test")
    b = await r.resolve("nope.allowed.test")
    assert a.error == "nxdomain" and b is a
    assert a.addresses == () and a.ttl == 5
    assert upstream.queries("nope.allowed.test", "A") == 1


async def test_servfail(upstream: Upstream) -> None:
    res = await make(upstream).resolve("broken.allowed.test")
    assert res.error == "servfail"
    assert res.addresses == ()


async def test_timeout(upstream: Upstream) -> None:
    res = await make(upstream, timeout=0.3).resolve("slow.allowed.test")
    assert res.error == "timeout"
    assert res.addresses == ()


async def test_stopped_server_fails_closed() -> None:
    port = free_udp_port("127.0.0.1")
    r = Resolver([f"127.0.0.1:{port}"], AddressPolicy(), timeout=0.3)
    res = await r.resolve("allowed.test")
    assert res.error in ("servfail", "timeout")
    assert res.addresses == ()


async def test_invalid_name(upstream: Upstream) -> None:
    res = await make(upstream).resolve("a" * 64 + ".test")
    assert res.error == "invalid_name"
    assert res.addresses == ()


async def test_cancelled_caller_does_not_break_waiters(upstream: Upstream) -> None:
    r = make(upstream)
    first = asyncio.ensure_future(r.resolve("other.test"))
    second = asyncio.ensure_future(r.resolve("other.test"))
    await asyncio.sleep(0)
    first.cancel()
    res = await second
    assert res.addresses == ("93.184.216.35",)
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_cache_bounded(upstream: Upstream) -> None:
    r = make(upstream, max_entries=3)
    for i in range(6):
        await r.resolve(f"n{i}.allowed.test")
    assert r.cached("n0.allowed.test") is None
    assert r.cached("n5.allowed.test") is not None
