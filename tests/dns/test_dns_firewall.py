"""The DNS firewall over real UDP/TCP sockets on loopback, real dnslib upstream,
dnspython and dig as clients."""

from __future__ import annotations

import asyncio
import random
import subprocess
from typing import Any

import dns.asyncquery
import dns.edns
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest
from dns_harness import Harness, loopback, start_harness
from dns_upstream import Upstream
from polling import async_wait_until
from prometheus_client import generate_latest
from stockade.policy.ruleset import RuleSet


async def ask(
    h: Harness,
    name: str,
    qtype: str = "A",
    *,
    tcp: bool = False,
    payload: int | None = None,
    source: str | None = None,
) -> dns.message.Message:
    q = dns.message.make_query(name, qtype, use_edns=payload is not None, payload=payload or 512)
    src = source or h.client_ip
    if tcp:
        return await dns.asyncquery.tcp(q, h.host, port=h.port, source=src, timeout=3)
    return await dns.asyncquery.udp(q, h.host, port=h.port, source=src, timeout=3)


def addrs(resp: dns.message.Message) -> set[str]:
    return {rd.address for rrset in resp.answer for rd in rrset if hasattr(rd, "address")}


async def test_allowed_name_answered(harness: Harness) -> None:
    r = await ask(harness, "allowed.test")
    assert r.rcode() == dns.rcode.NOERROR
    assert addrs(r) == {"93.184.216.34"}
    r6 = await ask(harness, "ALLOWED.test.", "AAAA")
    assert addrs(r6) == {"2606:2800:220:1:248:1893:25c8:1946"}
    ev = harness.events[-1]
    assert ev["event"]["action"] == "dns_decision"
    assert ev["dns"]["question"] == {"name": "allowed.test", "type": "AAAA"}
    assert ev["labels"]["task_id"] == "task-1"


async def test_case_echoed_for_0x20(harness: Harness) -> None:
    r = await ask(harness, "AlLoWeD.TeSt")
    assert r.question[0].name.to_text() == "AlLoWeD.TeSt."


async def test_unlisted_name_refused_with_event(harness: Harness) -> None:
    r = await ask(harness, "other.test")
    assert r.rcode() == dns.rcode.REFUSED
    assert not r.answer
    ev = harness.denials("no_matching_rule")[-1]
    assert ev["dns"]["question"] == {"name": "other.test", "type": "A"}
    assert ev["event"]["category"] == ["network"]
    assert ev["dns"]["response_code"] == "REFUSED"


async def test_deny_entry_wins(harness: Harness) -> None:
    r = await ask(harness, "denied.allowed.test")
    assert r.rcode() == dns.rcode.REFUSED
    assert harness.denials("denied_by_rule")[-1]["rule"]["id"] == "carve-out"


async def test_nxdomain_deny_rcode(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset, deny_rcode="NXDOMAIN")
    try:
        r = await ask(h, "other.test")
        assert r.rcode() == dns.rcode.NXDOMAIN
        assert h.denials("no_matching_rule")
    finally:
        await h.fw.stop()


async def test_unknown_task_refused(harness: Harness) -> None:
    for _ in range(10):
        r = await ask(harness, "allowed.test", source="127.0.0.1")
        assert r.rcode() == dns.rcode.REFUSED
    # refused every time, logged once a second per source (no task, no rate budget)
    assert 1 <= len(harness.denials("unknown_task")) < 10


async def test_cname_chain_allowed_and_escaping(harness: Harness) -> None:
    r = await ask(harness, "alias.allowed.test")
    assert r.rcode() == dns.rcode.NOERROR
    kinds = [rrset.rdtype for rrset in r.answer]
    assert kinds.count(dns.rdatatype.CNAME) == 2
    assert addrs(r) == {"93.184.216.34"}
    # a CNAME leading outside the allowed names is refused: the chain is checked too
    r2 = await ask(harness, "escape.allowed.test")
    assert r2.rcode() == dns.rcode.REFUSED
    assert not r2.answer
    ev = harness.denials("no_matching_rule")[-1]
    assert ev["stockade"]["cname"] == "other.test"
    r3 = await ask(harness, "alias.allowed.test", "CNAME")
    assert [rd.target.to_text() for rrset in r3.answer for rd in rrset] == ["mid.allowed.test."]


async def test_forbidden_addresses_never_answered(harness: Harness) -> None:
    r = await ask(harness, "private.allowed.test")
    assert addrs(r) == {"93.184.216.40"}
    assert harness.events[-1]["stockade"]["forbidden_addresses"] == ["10.0.0.1 private"]
    for qtype in ("A", "AAAA"):
        r = await ask(harness, "metadata.allowed.test", qtype)
        assert r.rcode() == dns.rcode.REFUSED
        assert not r.answer
    assert len(harness.denials("address_forbidden")) == 2


@pytest.mark.parametrize("qtype", ["TXT", "NULL", "ANY", "MX", "SRV", "PTR", "AXFR"])
async def test_qtypes_refused(harness: Harness, qtype: str) -> None:
    r = await ask(harness, "allowed.test", qtype, tcp=qtype == "AXFR")
    assert r.rcode() == dns.rcode.REFUSED
    ev = harness.denials("qtype_refused")[-1]
    assert ev["dns"]["question"]["type"] == qtype


@pytest.mark.parametrize("qtype", ["HTTPS", "SVCB"])
async def test_https_svcb_answered_empty(harness: Harness, qtype: str) -> None:
    r = await ask(harness, "allowed.test", qtype)
    assert r.rcode() == dns.rcode.NOERROR
    assert not r.answer
    assert upstream_not_asked(harness, qtype)


def upstream_not_asked(h: Harness, qtype: str) -> bool:
    return h.fw.resolver.upstream_queries == 0


async def test_servfail_on_upstream_failure(harness: Harness) -> None:
    r = await ask(harness, "broken.allowed.test")
    assert r.rcode() == dns.rcode.SERVFAIL
    r2 = await ask(harness, "slow.allowed.test")
    assert r2.rcode() == dns.rcode.SERVFAIL
    evs = harness.denials("resolve_failed")
    assert {e["stockade"]["resolve_error"] for e in evs} == {"servfail", "timeout"}
    assert all(e["dns"]["response_code"] == "SERVFAIL" for e in evs)


async def test_stopped_upstream_servfail(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset)
    try:
        upstream.stop()
        r = await ask(h, "www.allowed.test")
        assert r.rcode() == dns.rcode.SERVFAIL
    finally:
        await h.fw.stop()


async def test_nxdomain_passed_through(harness: Harness) -> None:
    r = await ask(harness, "missing.allowed.test")
    assert r.rcode() == dns.rcode.NXDOMAIN


async def test_ttl_clamped(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset, ttl_min_s=7, ttl_max_s=100)
    try:
        r = await ask(h, "rebind.allowed.test")  # upstream TTL 0
        assert r.answer[0].ttl == 7
        upstream.zone.a["rebind.allowed.test"] = ["10.1.1.1"]
        again = await ask(h, "rebind.allowed.test")
        assert addrs(again) == {"93.184.216.41"}  # no rebinding within the clamp
        r2 = await ask(h, "long-ttl.allowed.test")  # upstream TTL 86400
        assert 7 <= r2.answer[0].ttl <= 100
        assert upstream.queries("rebind.allowed.test", "A") == 1
    finally:
        await h.fw.stop()


async def test_truncation_and_tcp_fallback(harness: Harness) -> None:
    small = await ask(harness, "big.allowed.test")  # no EDNS: 512-byte buffer
    assert small.flags & dns.flags.TC
    assert not small.answer
    edns = await ask(harness, "big.allowed.test", payload=4096)
    assert not edns.flags & dns.flags.TC
    assert len(addrs(edns)) == 60
    assert edns.edns == 0
    over_tcp = await ask(harness, "big.allowed.test", tcp=True)
    assert len(addrs(over_tcp)) == 60
    # dnspython's udp_with_fallback retries over TCP exactly as a stub resolver does
    q = dns.message.make_query("big.allowed.test", "A")
    resp, used_tcp = await dns.asyncquery.udp_with_fallback(
        q, harness.host, port=harness.port, source=harness.client_ip, timeout=3
    )
    assert used_tcp and len(addrs(resp)) == 60


async def test_label_and_name_caps(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset, max_label_length=20, max_name_length=60)
    try:
        r = await ask(h, "a" * 21 + ".allowed.test")
        assert r.rcode() == dns.rcode.REFUSED
        assert h.denials("label_too_long")
        r = await ask(h, ".".join(["abcdefghij"] * 6) + ".allowed.test")
        assert r.rcode() == dns.rcode.REFUSED
        assert h.denials("name_too_long")
        assert h.fw.resolver.upstream_queries == 0  # never forwarded
    finally:
        await h.fw.stop()


async def test_high_entropy_label(harness: Harness) -> None:
    rng = random.Random(7)
    label = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz234567") for _ in range(40))
    r = await ask(harness, f"{label}.allowed.test")
    assert r.rcode() == dns.rcode.REFUSED
    assert harness.denials("high_entropy_label")
    assert harness.fw.resolver.upstream_queries == 0
    ok = await ask(harness, "www.allowed.test")
    assert ok.rcode() == dns.rcode.NOERROR


async def test_query_rate_budget(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset, queries_per_second=0.001, query_burst=5)
    try:
        codes = [(await ask(h, "allowed.test")).rcode() for _ in range(12)]
        assert codes[:5] == [dns.rcode.NOERROR] * 5
        assert set(codes[5:]) == {dns.rcode.REFUSED}
        # a flood is logged, but not one event per packet
        assert 1 <= len(h.denials("query_rate_exceeded")) < 7
    finally:
        await h.fw.stop()


async def test_unresolvable_name_budget(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset, unresolvable_names_per_minute=5)
    try:
        for i in range(5):
            r = await ask(h, f"chunk{i}.allowed.test")
            assert r.rcode() == dns.rcode.NXDOMAIN
        r = await ask(h, "chunk5.allowed.test")
        assert r.rcode() == dns.rcode.REFUSED
        ev = h.denials("unresolvable_name_budget")[-1]
        assert ev["rule"]["id"] == "allowed-subdomains"
        assert upstream.queries("chunk5.allowed.test", "A") == 0  # refused before upstream
        # names already answered (cached) still resolve; the apex rule has its own budget
        assert (await ask(h, "chunk1.allowed.test")).rcode() == dns.rcode.NXDOMAIN
        assert (await ask(h, "allowed.test")).rcode() == dns.rcode.NOERROR
    finally:
        await h.fw.stop()


async def test_report_mode_answers_and_flags(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset, profile="dns-report")
    try:
        r = await ask(h, "other.test")
        assert r.rcode() == dns.rcode.NOERROR
        assert addrs(r) == {"93.184.216.35"}
        ev = h.events[-1]
        assert ev["stockade"]["report_only"] is True
        assert ev["event"]["reason"] == "no_matching_rule"
        # report mode never relaxes the firewall's own guards
        assert (await ask(h, "other.test", "TXT")).rcode() == dns.rcode.REFUSED
    finally:
        await h.fw.stop()


async def test_malformed_dropped_and_counted(harness: Harness) -> None:
    loop = asyncio.get_running_loop()
    received: list[bytes] = []

    class Proto(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: object) -> None:
            received.append(data)

    transport, _ = await loop.create_datagram_endpoint(
        Proto, local_addr=(harness.client_ip, 0), remote_addr=(harness.host, harness.port)
    )
    try:
        for junk in (b"", b"\x00", b"\xff" * 11, b"\x12\x34" + b"\xff" * 40, b"\x00" * 12):
            transport.sendto(junk)
        ok = await ask(harness, "allowed.test")  # the server is alive afterwards
        assert ok.rcode() == dns.rcode.NOERROR
    finally:
        transport.close()
    # (an empty datagram is not sent by asyncio, so four of the five reach the server)
    reg = harness.fw.metrics_registry
    assert reg.get_sample_value("stockade_dns_malformed_packets_total") == 4
    assert received == []
    ev = harness.denials("malformed_query")
    assert len(ev) == 1  # one event per source per second, not one per packet
    assert ev[0]["source"]["ip"] == harness.client_ip
    assert ev[0]["labels"]["task_id"] == "task-1"


async def test_metrics(harness: Harness) -> None:
    await ask(harness, "allowed.test")
    await ask(harness, "allowed.test")
    await ask(harness, "other.test")
    reg = harness.fw.metrics_registry
    assert reg.get_sample_value("stockade_dns_cache_hits_total") == 1
    assert reg.get_sample_value("stockade_dns_cache_misses_total") == 1
    labels = {"outcome": "denied", "reason": "no_matching_rule", "transport": "udp"}
    assert reg.get_sample_value("stockade_dns_queries_total", labels) == 1
    assert "stockade_dns_queries_total" in generate_latest(reg).decode()


async def test_dig_client(harness: Harness) -> None:
    def dig(*args: str) -> str:
        out = subprocess.run(
            [
                "dig",
                "+tries=1",
                "+time=3",
                "-b",
                harness.client_ip,
                "-p",
                str(harness.port),
                f"@{harness.host}",
                *args,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=20,
        )
        return out.stdout

    out = await asyncio.to_thread(dig, "+short", "allowed.test", "A")
    assert out.split() == ["93.184.216.34"]
    refused = await asyncio.to_thread(dig, "allowed.test", "TXT")
    assert "status: REFUSED" in refused
    big = await asyncio.to_thread(dig, "+short", "+bufsize=512", "big.allowed.test")
    assert len(big.split()) == 60  # dig retried over TCP after TC
    tcp = await asyncio.to_thread(dig, "+tcp", "+short", "www.allowed.test")
    assert tcp.split() == ["93.184.216.36"]


async def test_log_allowed_off_logs_only_denials(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset, log_allowed=False)
    try:
        assert (await ask(h, "allowed.test")).rcode() == dns.rcode.NOERROR
        assert (await ask(h, "other.test")).rcode() == dns.rcode.REFUSED
        assert [e["stockade"]["decision"] for e in h.events] == ["denied"]
    finally:
        await h.fw.stop()


async def test_rules_source_callable_and_reload(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset)
    try:
        current: list[RuleSet] = [ruleset]
        h.fw.set_rules(lambda: current[0])
        assert (await ask(h, "allowed.test")).rcode() == dns.rcode.NOERROR

        def not_loaded() -> RuleSet:
            raise RuntimeError("rules not loaded")

        h.fw.set_rules(not_loaded)  # no rules in force: refuse, never answer
        assert (await ask(h, "allowed.test")).rcode() == dns.rcode.REFUSED
        h.fw.set_rules(None)
        assert (await ask(h, "allowed.test")).rcode() == dns.rcode.REFUSED
    finally:
        await h.fw.stop()


async def test_unknown_edns_version_badvers(harness: Harness) -> None:
    q = dns.message.make_query("allowed.test", "A", use_edns=1)
    r = await dns.asyncquery.udp(
        q, harness.host, port=harness.port, source=harness.client_ip, timeout=3
    )
    assert r.rcode() == dns.rcode.BADVERS
    assert not r.answer


async def test_tcp_junk_and_idle_connections(upstream: Upstream, ruleset: RuleSet) -> None:
    h = await start_harness(upstream, ruleset, tcp_idle_timeout_s=0.2)
    try:
        # junk inside a length prefix: dropped and counted, the connection goes away
        reader, writer = await asyncio.open_connection(h.host, h.port, local_addr=(h.client_ip, 0))
        writer.write(b"\x00\x05hello")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        # a client that connects and says nothing is closed after the idle timeout
        reader, writer = await asyncio.open_connection(h.host, h.port, local_addr=(h.client_ip, 0))
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        # several queries on one connection are answered in order
        reader, writer = await asyncio.open_connection(h.host, h.port, local_addr=(h.client_ip, 0))
        for name in ("allowed.test", "other.test"):
            wire = dns.message.make_query(name, "A").to_wire()
            writer.write(len(wire).to_bytes(2, "big") + wire)
        await writer.drain()
        codes = []
        for _ in range(2):
            n = int.from_bytes(await asyncio.wait_for(reader.readexactly(2), 10), "big")
            codes.append(dns.message.from_wire(await reader.readexactly(n)).rcode())
        assert codes == [dns.rcode.NOERROR, dns.rcode.REFUSED]
        writer.close()
        reg = h.fw.metrics_registry
        assert reg.get_sample_value("stockade_dns_malformed_packets_total") == 1
        assert (await ask(h, "allowed.test", tcp=True)).rcode() == dns.rcode.NOERROR
    finally:
        await h.fw.stop()


async def _tcp_query(h: Harness, source: str, name: str = "allowed.test") -> tuple[Any, int | None]:
    """Open a DNS/TCP connection from `source`, ask once: (writer, rcode or None if the
    firewall closed the connection without an answer). The connection stays open."""
    reader, writer = await asyncio.open_connection(h.host, h.port, local_addr=(source, 0))
    wire = dns.message.make_query(name, "A").to_wire()
    try:  # a refused connection is closed at once: EOF or a reset, whichever comes first
        writer.write(len(wire).to_bytes(2, "big") + wire)
        await writer.drain()
        head = await asyncio.wait_for(reader.readexactly(2), 10)
    except (ConnectionError, asyncio.IncompleteReadError):
        return writer, None
    body = await asyncio.wait_for(reader.readexactly(int.from_bytes(head, "big")), 10)
    return writer, dns.message.from_wire(body).rcode()


async def test_tcp_connections_are_shared_per_task(upstream: Upstream, ruleset: RuleSet) -> None:
    """One task holding its whole share of DNS/TCP connections open does not stop another
    task's DNS/TCP query; the global cap still holds over all of them."""
    from stockade.tasks import Task

    h = await start_harness(upstream, ruleset, max_tcp_connections=5,
                            max_tcp_connections_per_task=3, tcp_idle_timeout_s=60)
    other, third = loopback(), loopback()
    h.registry.register(Task("task-2", other, "dns-test"))
    h.registry.register(Task("task-3", third, "dns-test"))
    held = []
    try:
        results = []
        for _ in range(8):
            writer, rcode = await _tcp_query(h, h.client_ip)
            held.append(writer)
            results.append(rcode)
        assert results == [dns.rcode.NOERROR] * 3 + [None] * 5
        for _ in range(2):  # the other task gets its queries answered meanwhile
            writer, rcode = await _tcp_query(h, other)
            held.append(writer)
            assert rcode == dns.rcode.NOERROR
        writer, rcode = await _tcp_query(h, third)  # 5 held: the global cap
        held.append(writer)
        assert rcode is None
        reg = h.fw.metrics_registry
        sample = reg.get_sample_value
        assert sample("stockade_dns_queries_total", {
            "outcome": "denied", "reason": "tcp_connection_limit_per_source",
            "transport": "tcp"}) == 5
        assert sample("stockade_dns_queries_total", {
            "outcome": "denied", "reason": "tcp_connection_limit_global",
            "transport": "tcp"}) == 1
        for w in held[:3]:  # closing gives the shares back
            w.close()
        await async_wait_until(lambda: h.fw._tcp_shares.count <= 2, 5)
        writer, rcode = await _tcp_query(h, third)
        held.append(writer)
        assert rcode == dns.rcode.NOERROR
    finally:
        for w in held:
            w.close()
        await h.fw.stop()
