"""The sans-IO parts: guards, packet codec, decision core, and fuzzing of the whole
synchronous query path (`DnsFirewall.answer_now`) with a warm resolver cache."""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Iterator
from typing import Any

import dns.flags
import dns.message
import dns.rdatatype
import pytest
from dns_harness import loopback
from dns_upstream import Upstream
from dnslib import EDNS0, RCODE, DNSRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from stockade.gateway.dns.decide import (
    NeedResolve,
    Outcome,
    before_upstream,
    name_from_labels,
    outcome_event,
    precheck,
)
from stockade.gateway.dns.firewall import DnsFirewall
from stockade.gateway.dns.guards import GuardState, TokenBucket, UnresolvableWindow, shannon_entropy
from stockade.gateway.dns.packet import (
    Malformed,
    Record,
    Reply,
    build_response,
    display_name,
    parse_query,
)
from stockade.gateway.dns.settings import DnsSettings
from stockade.policy.decide import decide_name
from stockade.policy.ruleset import RuleSet

from stockade.events import validate
from stockade.net.addresses import AddressPolicy
from stockade.net.resolver import Resolver
from stockade.tasks.registry import Task, TaskRegistry


def wire(name: str, qtype: str = "A", edns: int | None = None) -> bytes:
    q = DNSRecord.question(name, qtype)
    if edns is not None:
        q.add_ar(EDNS0(udp_len=edns))
    return bytes(q.pack())


# -- guards ------------------------------------------------------------------------


def test_entropy() -> None:
    assert shannon_entropy(b"") == 0.0
    assert shannon_entropy(b"aaaa") == 0.0
    assert shannon_entropy(b"abcdefghijklmnop") == pytest.approx(4.0)
    assert shannon_entropy(b"ABab") == pytest.approx(1.0)  # case-insensitive, like DNS
    assert shannon_entropy(b"files-pythonhosted") < 4.0


def test_token_bucket() -> None:
    b = TokenBucket.full(rate=2.0, burst=3, now=100.0)
    assert [b.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert b.take(100.5)  # half a second refills one token at 2/s
    assert not b.take(100.5)
    assert b.take(110.0)


def test_unresolvable_window() -> None:
    w = UnresolvableWindow()
    for i in range(3):
        w.record(f"n{i}", cap=3, now=10.0)
    assert w.exhausted("n9", cap=3, now=20.0)
    assert not w.exhausted("n1", cap=3, now=20.0)  # a name already counted is fine
    assert not w.exhausted("n9", cap=3, now=71.0)  # the minute has passed
    w.record("x", cap=3, now=71.0)
    assert len(w.seen) == 1


def test_guard_state_forget() -> None:
    g = GuardState(rate=1.0, burst=1, unresolvable_cap=1)
    assert g.allow_query("t", 0.0)
    assert not g.allow_query("t", 0.0)
    g.forget("t")
    assert g.allow_query("t", 0.0)
    assert g.rate_event_due("t", 5.0) == 0
    assert g.rate_event_due("t", 5.1) is None
    assert g.rate_event_due("t", 6.2) == 1


# -- packet ------------------------------------------------------------------------


def test_parse_query_fields() -> None:
    q = parse_query(wire("Www.Example.ORG", "AAAA", edns=1400))
    assert q.labels == (b"Www", b"Example", b"ORG")
    assert q.qtype == 28 and q.qtype_name == "AAAA"
    assert q.edns and q.udp_size == 1400
    plain = parse_query(wire("a.b"))
    assert not plain.edns and plain.udp_size == 512


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00" * 11, b"\x00" * 12, DNSRecord.question("a.b").reply().pack(), b"\xff" * 64],
)
def test_parse_query_malformed(data: bytes) -> None:
    with pytest.raises(Malformed):
        parse_query(data)


def test_display_name_escapes() -> None:
    assert display_name((b"a\x00b", b"c.d")) == "a\\000b.c\\046d"
    assert display_name(()) == "."


def test_name_from_labels_refuses_odd_bytes() -> None:
    assert name_from_labels((b"www", b"example", b"org")) == "www.example.org"
    assert name_from_labels((b"a.b", b"org")) is None
    assert name_from_labels((b"\xc3\xa9", b"org")) is None
    assert name_from_labels((b"a\x00", b"org")) is None
    assert name_from_labels(()) is None


@given(st.integers(1, 200), st.integers(512, 4096))
def test_response_never_exceeds_buffer(n: int, size: int) -> None:
    q = parse_query(wire("big.example.org", edns=size))
    recs = tuple(
        Record(None, "A", 60, str(ipaddress.IPv4Address(0x5DB80000 + i))) for i in range(n)
    )
    data, truncated = build_response(q, Reply(RCODE.NOERROR, recs), q.udp_size)
    assert len(data) <= size
    parsed = DNSRecord.parse(data)
    assert bool(parsed.header.tc) == truncated
    assert len(parsed.rr) == (0 if truncated else n)


# -- the decision core -----------------------------------------------------------


@pytest.fixture
def core(ruleset: RuleSet) -> tuple[Task, RuleSet, DnsSettings, GuardState]:
    s = DnsSettings()
    return (
        Task("t1", "10.9.0.2", "dns-test"),
        ruleset,
        s,
        GuardState(s.queries_per_second, s.query_burst, s.unresolvable_names_per_minute),
    )


def decide(core: Any, data: bytes, task: Task | None = None) -> Outcome | NeedResolve:
    t, rs, s, g = core
    return precheck(parse_query(data), task or t, rs, s, g, now=1.0)


def test_precheck_paths(core: Any) -> None:
    step = decide(core, wire("WWW.allowed.test."))
    assert isinstance(step, NeedResolve) and step.name == "www.allowed.test"
    assert step.verdict.rule_id == "allowed-subdomains"
    expectations = {
        wire("other.test"): "no_matching_rule",
        wire("denied.allowed.test"): "denied_by_rule",
        wire("allowed.test", "TXT"): "qtype_refused",
        wire("allowed.test", "NULL"): "qtype_refused",
        wire("allowed.test", "ANY"): "qtype_refused",
        wire("x" * 63 + ".allowed.test"): "high_entropy_label"
        if shannon_entropy(b"x" * 63) >= 4
        else None,
        wire("q8z3k1v7m2p9w4r6t0y5.allowed.test"): "high_entropy_label",
        wire("127.0.0.1"): "no_matching_rule",
    }
    for data, reason in expectations.items():
        out = decide(core, data)
        if reason is None:
            assert isinstance(out, NeedResolve)
            continue
        assert isinstance(out, Outcome), reason
        assert (out.decision, str(out.reason)) == ("denied", reason)
        assert out.reply is not None and out.reply.rcode == RCODE.REFUSED
        validate(outcome_event(parse_query(data), out, core[0], "10.9.0.2", 1234, "udp"))
    https = decide(core, wire("allowed.test", "HTTPS"))
    assert isinstance(https, Outcome) and https.decision == "allowed"
    assert https.reply is not None and https.reply.answers == ()


def test_precheck_unknown_task_and_profile(core: Any) -> None:
    t, rs, s, g = core
    q = parse_query(wire("allowed.test"))
    out = precheck(q, None, rs, s, g, now=1.0)
    assert isinstance(out, Outcome) and out.reason == "unknown_task"
    ghost = Task("t2", "10.9.0.3", "no-such-profile")
    out = precheck(q, ghost, rs, s, g, now=1.0)
    assert isinstance(out, Outcome) and out.reason == "unknown_profile"
    out = precheck(q, t, None, s, g, now=1.0)
    assert isinstance(out, Outcome) and out.decision == "denied"


def test_precheck_bad_opcode_and_class(core: Any) -> None:
    rec = DNSRecord.question("allowed.test")
    rec.header.opcode = 2
    out = decide(core, rec.pack())
    assert isinstance(out, Outcome) and out.reply is not None and out.reply.rcode == RCODE.NOTIMP
    rec = DNSRecord.question("allowed.test", qclass="CH")
    out = decide(core, rec.pack())
    assert isinstance(out, Outcome) and out.reason == "qtype_refused"


def test_before_upstream_budget(core: Any) -> None:
    t, _rs, s, g = core
    step = decide(core, wire("a.allowed.test"))
    assert isinstance(step, NeedResolve)
    for i in range(s.unresolvable_names_per_minute):
        g.record_unresolvable(t.task_id, "allowed-subdomains", f"n{i}.allowed.test", 1.0)
    out = before_upstream(t, step, s, g, 2.0)
    assert out is not None and out.reason == "unresolvable_name_budget"
    assert before_upstream(t, step, s, g, 62.0) is None


# -- fuzzing the whole synchronous path ---------------------------------------------

CLIENT = "10.9.0.2"
ALLOWED_SAMPLES = [
    wire("allowed.test"),
    wire("allowed.test", "AAAA", edns=1232),
    wire("alias.allowed.test"),
    wire("private.allowed.test"),
    wire("metadata.allowed.test", "AAAA"),
    wire("big.allowed.test", edns=4096),
    wire("other.test"),
    wire("escape.allowed.test"),
]


@pytest.fixture(scope="module")
def warm_firewall(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[DnsFirewall, RuleSet]]:
    from dns_harness import PROFILE
    from stockade.policy.loader import load_rules

    root = tmp_path_factory.mktemp("fuzzrules")
    for d in ("profiles", "apis", "presets", "tests"):
        (root / d).mkdir()
    (root / "profiles" / "p.yaml").write_text(PROFILE)
    rules = load_rules(root)
    with Upstream() as up:
        resolver = Resolver([up.server], AddressPolicy(), ttl_min=3600, ttl_max=3600)

        async def warm() -> None:
            for n in (
                "allowed.test",
                "alias.allowed.test",
                "private.allowed.test",
                "metadata.allowed.test",
                "big.allowed.test",
                "escape.allowed.test",
                "other.test",
            ):
                await resolver.resolve(n)

        asyncio.run(warm())
    registry = TaskRegistry()
    registry.register(Task("fuzz", CLIENT, "dns-test"))
    s = DnsSettings(listen=[f"{loopback()}:0"], queries_per_second=1e9, query_burst=10**9)
    events: list[dict[str, Any]] = []
    fw = DnsFirewall(s, resolver, registry, rules, events.append, CollectorRegistry())
    yield fw, rules


def _mutate(data: bytes, flips: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(data)
    for pos, val in flips:
        if b:
            b[pos % len(b)] = val
    if cut is not None:
        b = b[: cut % (len(b) + 1)]
    return bytes(b)


fuzz_inputs = st.one_of(
    st.binary(max_size=600),
    st.builds(
        _mutate,
        st.sampled_from(ALLOWED_SAMPLES),
        st.lists(st.tuples(st.integers(0, 600), st.integers(0, 255)), max_size=6),
        st.one_of(st.none(), st.integers(0, 600)),
    ),
)


@settings(max_examples=600, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=fuzz_inputs)
def test_fuzzed_packets_never_crash_or_allow(
    warm_firewall: tuple[DnsFirewall, RuleSet], data: bytes
) -> None:
    fw, rules = warm_firewall
    reply, _pending = fw.answer_now(data, (CLIENT, 5353), "udp")
    if reply is None:
        return
    _id, flags, _qd, ancount = struct.unpack_from("!HHHH", reply)
    assert flags & 0x8000
    if (flags >> 11) & 0xF:
        assert ancount == 0  # other opcodes (UPDATE, ...) never get records
        return
    # dnspython (not dnslib, which rejects non-UTF-8 labels) checks what we sent
    resp = dns.message.from_wire(reply, question_only=False)
    assert resp.flags & dns.flags.QR
    if not resp.answer:
        return
    # anything answered: the question was an allowed name of a resolved type, and every
    # record's owner/target and address passes the policy and the address registry
    q = resp.question[0]
    assert dns.rdatatype.to_text(q.rdtype) in ("A", "AAAA", "CNAME")
    qname = q.name.to_text().rstrip(".").lower()
    assert decide_name(rules, "dns-test", qname).allowed
    for rrset in resp.answer:
        for rd in rrset:
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                assert AddressPolicy().check(rd.address) is None
            else:
                assert decide_name(rules, "dns-test", rd.target.to_text().rstrip(".")).allowed
    assert len(reply) <= parse_query(data).udp_size


# -- the fast codec path agrees with dnslib --------------------------------------------

query_samples = st.builds(
    lambda name, qtype, edns, rd: _sample(name, qtype, edns, rd),
    st.lists(st.binary(min_size=1, max_size=20), min_size=0, max_size=5),
    st.sampled_from(["A", "AAAA", "TXT", "HTTPS", "ANY", "CNAME"]),
    st.one_of(st.none(), st.integers(0, 65535)),
    st.booleans(),
)


def _sample(labels: list[bytes], qtype: str, edns: int | None, rd: bool) -> bytes:
    from dnslib import QTYPE, DNSHeader, DNSLabel, DNSQuestion

    name = DNSLabel(labels) if labels else DNSLabel(".")
    # an explicit header: dnslib's default one draws a random id
    q = DNSRecord(DNSHeader(id=4242, rd=int(rd)), q=DNSQuestion(name, getattr(QTYPE, qtype)))
    if edns is not None:
        q.add_ar(EDNS0(udp_len=edns))
    return bytes(q.pack())


@given(st.one_of(query_samples, st.binary(min_size=12, max_size=80)))
def test_fast_parse_agrees_with_dnslib(data: bytes) -> None:
    from stockade.gateway.dns.packet import parse_query_dnslib, parse_query_fast

    fast = parse_query_fast(data)
    if fast is None:
        return
    try:
        slow = parse_query_dnslib(data)
    except Malformed:
        # dnslib refuses some label bytes (non-UTF-8); such names are refused later
        # anyway (name_from_labels), so the fast path may accept what dnslib rejects
        assert name_from_labels(fast.labels) is None or fast.labels == ()
        return
    assert fast == slow


def test_root_name_answers_take_the_dnslib_path() -> None:
    from stockade.gateway.dns.packet import build_response, build_response_dnslib

    q = parse_query(bytes.fromhex("abcd010000010000000000000000010001"))
    assert q.labels == ()
    reply = Reply(RCODE.NOERROR, (Record(None, "A", 30, "192.0.2.1"),))
    for size in (12, 17, 32, 512):
        assert build_response(q, reply, size) == build_response_dnslib(q, reply, size)


@given(
    query_samples,
    st.lists(
        st.one_of(
            st.builds(
                lambda v: Record(None, "A", 60, str(ipaddress.IPv4Address(v))),
                st.integers(0, 2**32 - 1),
            ),
            st.builds(
                lambda v: Record(None, "AAAA", 30, str(ipaddress.IPv6Address(v))),
                st.integers(0, 2**128 - 1),
            ),
        ),
        max_size=40,
    ),
    st.sampled_from([RCODE.NOERROR, RCODE.NXDOMAIN, RCODE.REFUSED, RCODE.SERVFAIL]),
    st.integers(12, 4096),
)
def test_fast_build_agrees_with_dnslib(
    data: bytes, records: list[Record], rcode: int, size: int
) -> None:
    import dns.message
    from stockade.gateway.dns.packet import build_response_dnslib, build_response_fast

    q = parse_query(data)
    if not q.labels:
        return  # root-name queries never take the fast path (see build_response)
    try:
        slow, slow_tc = build_response_dnslib(q, Reply(rcode, tuple(records)), size)
    except Exception:
        return  # dnslib cannot encode some label bytes; the fast path is the only one then
    fast, fast_tc = build_response_fast(q, Reply(rcode, tuple(records)), size)
    assert len(fast) <= max(size, 12)
    assert fast_tc == slow_tc or len(fast) <= size < len(slow)
    a = dns.message.from_wire(fast, question_only=fast_tc)
    b = dns.message.from_wire(slow, question_only=slow_tc)
    assert a.id == b.id and a.rcode() == b.rcode() and a.flags == b.flags
    if not fast_tc and not slow_tc:
        assert a.answer == b.answer
        assert a.question == b.question
