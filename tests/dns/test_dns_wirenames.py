"""The bounded dnslib parse (gateway/dns/wirenames.py): hostile compression pointers and
section counts cost a bounded number of bounded name decodings, and on what dnslib
itself parses the result is dnslib's."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import pytest
from dnslib import CNAME, MX, NS, QTYPE, RR, SOA, A, DNSLabel, DNSQuestion, DNSRecord
from dnslib.buffer import BufferError as DnsBufferError
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.gateway.dns.packet import MAX_QUERY_RECORDS, Malformed, parse_query
from stockade.gateway.dns.wirenames import (
    MAX_POINTERS,
    BoundedNameBuffer,
    parse_message,
)


def _chained(counts: tuple[int, int, int, int], qtype: int = 1) -> bytes:
    """A message whose every name is one label plus a pointer to the name before it,
    `counts` (questions, answers, authority, additional) of them: dnslib followed
    1 + 2 + ... + n pointers to decode them all."""
    body = bytearray()
    prev: int | None = None
    for i in range(sum(counts)):
        start = 12 + len(body)
        body += b"\x01a" + (b"\x00" if prev is None else struct.pack("!H", 0xC000 | prev))
        body += struct.pack("!HH", qtype, 1)
        if i >= counts[0]:
            body += struct.pack("!IH", 60, 4) + b"\x7f\x00\x00\x01"  # ttl, an A's rdata
        prev = start
    return struct.pack("!HHHHHH", 7, 0x0100, *counts) + bytes(body)


def _decode_calls(data: bytes) -> int:
    calls = 0
    real = BoundedNameBuffer.decode_name

    def counting(self: BoundedNameBuffer, last: int = -1) -> Any:
        nonlocal calls
        calls += 1
        return real(self, last)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BoundedNameBuffer, "decode_name", counting)
        with contextlib.suppress(Malformed):
            parse_query(data)
    return calls


def test_pointer_chained_questions_cost_one_name() -> None:
    # 4 KiB of questions chained by pointers took dnslib ~0.7 s (64 KiB over TCP: 3 s),
    # all on the event loop every task's DNS shares; now only the first is decoded
    data = _chained((510, 0, 0, 0))
    assert len(data) <= 4096
    assert _decode_calls(data) == 1
    q = parse_query(data)
    assert q.qdcount == 510 and q.labels == (b"a",)  # still refused FORMERR (qdcount)
    with pytest.raises(Malformed):
        parse_query(_chained((1, 0, 0, 400)))  # one question, hundreds of records


@settings(max_examples=200, deadline=None)
@given(
    st.tuples(
        st.integers(0, 300), st.integers(0, 100), st.integers(0, 100), st.integers(0, 100)
    ),
    st.sampled_from([1, 2, 5, 6, 15, 28, 41]),
)
def test_parse_decodes_a_bounded_number_of_names(
    counts: tuple[int, int, int, int], qtype: int
) -> None:
    # at most the question and every record's owner plus two rdata names (SOA)
    assert _decode_calls(_chained(counts, qtype)) <= 1 + 3 * MAX_QUERY_RECORDS


def _pointer_chain(links: int) -> tuple[bytes, int]:
    """(message bytes, offset of a pointer into a chain of `links` pointers)."""
    blob = bytearray(b"\x00" * 12 + b"\x01a\x00")
    prev = 12
    for _ in range(links - 1):
        start = len(blob)
        blob += b"\x01a" + struct.pack("!H", 0xC000 | prev)
        prev = start
    start = len(blob)
    blob += struct.pack("!H", 0xC000 | prev)
    return bytes(blob), start


def _decode_at(data: bytes, offset: int) -> DNSLabel:
    buf = BoundedNameBuffer(data)
    buf.offset = offset
    return buf.decode_name()


def test_pointer_chain_bounds() -> None:
    data, at = _pointer_chain(MAX_POINTERS)
    assert len(_decode_at(data, at).label) == MAX_POINTERS  # as long as a legal name gets
    data, at = _pointer_chain(MAX_POINTERS + 1)
    with pytest.raises(DnsBufferError):
        _decode_at(data, at)  # dnslib recursed through ~1,000 of these
    for bad in (
        b"\x00" * 12 + b"\xc0\x0c",  # a pointer to itself
        b"\x00" * 12 + b"\xc0\x0e\x00",  # forwards
        b"\x00" * 12 + b"\x01a\xc0\x0c",  # a loop through the label before it
        b"\x00" * 12 + b"\x05ab",  # a label past the end
        b"\x00" * 12 + b"\x02\xff\xfe\x00",  # not UTF-8 (dnslib refuses it too)
    ):
        with pytest.raises(DnsBufferError):
            _decode_at(bad, 12)


def _names() -> st.SearchStrategy[str]:
    label = st.text("abcxyz-09", min_size=1, max_size=8)
    return st.lists(label, min_size=1, max_size=4).map(".".join)


@settings(max_examples=200, deadline=None)
@given(
    _names(),
    st.lists(st.tuples(st.sampled_from(["A", "CNAME", "NS", "MX", "SOA"]), _names(), _names()),
             max_size=MAX_QUERY_RECORDS),
)
def test_bounded_parse_agrees_with_dnslib(qname: str, records: list[tuple[str, str, str]]) -> None:
    rdata = {
        "A": lambda _t: A("192.0.2.1"),
        "CNAME": CNAME,
        "NS": NS,
        "MX": lambda t: MX(t, 10),
        "SOA": lambda t: SOA(t, "admin." + t),
    }
    msg = DNSRecord(q=DNSQuestion(qname))
    for rtype, owner, target in records:
        msg.add_answer(RR(owner, getattr(QTYPE, rtype), rdata=rdata[rtype](target)))
    wire = bytes(msg.pack())  # dnslib compresses repeated suffixes with pointers
    ours, qdcount = parse_message(wire, MAX_QUERY_RECORDS)
    theirs = DNSRecord.parse(wire)
    assert qdcount == 1
    assert repr(ours.questions) == repr(theirs.questions)
    assert [repr(r) for r in ours.rr] == [repr(r) for r in theirs.rr]
    assert [r.rname.label for r in ours.rr] == [r.rname.label for r in theirs.rr]
