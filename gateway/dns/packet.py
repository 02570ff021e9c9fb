"""DNS wire format in and out: parse one query, build one response. Pure, no sockets.

dnslib does the general encoding and decoding. Two things are hand-written here:
- the hostile-input boundary (any exception from the parser means "malformed", the
  shape of a query we accept is checked explicitly) and the size discipline (a UDP
  answer never exceeds the client's advertised buffer: TC is set, the client retries
  over TCP);
- a fast path for the one shape that makes up nearly all traffic (one question, at
  most an OPT record; an answer of A/AAAA records without CNAMEs). dnslib's object
  model costs ~150 us per query, which alone would miss the 5,000 cached queries/s
  target on one core; the fast path is a few struct calls. Anything else takes the
  dnslib path, and tests check both paths agree on every input (differential fuzzing).
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, field
from functools import lru_cache

from dnslib import (
    AAAA,
    CNAME,
    EDNS0,
    QTYPE,
    RCODE,
    RR,
    A,
    DNSHeader,
    DNSLabel,
    DNSQuestion,
    DNSRecord,
)
from dnslib.buffer import Buffer

from .wirenames import parse_message

OPCODE_QUERY = 0
CLASS_IN = 1
TYPE_OPT = 41
PLAIN_UDP_SIZE = 512  # RFC 1035 limit without EDNS
MAX_TCP_SIZE = 65535


class Malformed(ValueError):
    """The bytes are not a DNS message we can even answer: drop them."""


@dataclass(frozen=True, slots=True)
class Query:
    id: int
    labels: tuple[bytes, ...]  # as received (case preserved, echoed back for 0x20 clients)
    qtype: int
    qclass: int
    rd: bool
    opcode: int
    qdcount: int
    edns: bool
    edns_version: int = 0
    udp_size: int = PLAIN_UDP_SIZE  # the client's buffer for UDP answers
    do: bool = False
    question_wire: bytes | None = field(default=None, compare=False)  # fast path only

    @property
    def qname(self) -> DNSLabel:
        return DNSLabel(list(self.labels))

    @property
    def qtype_name(self) -> str:
        return qtype_name(self.qtype)

    @property
    def display_name(self) -> str:
        """Presentation form for events: escaped, no trailing dot, bounded length."""
        return display_name(self.labels)


def qtype_name(qtype: int) -> str:
    try:
        return str(QTYPE[qtype])
    except Exception:  # dnslib raises its own error type for unknown numbers
        return f"TYPE{qtype}"


def display_name(labels: tuple[bytes, ...]) -> str:
    out = []
    for label in labels:
        out.append(
            "".join(
                chr(b) if 0x21 <= b <= 0x7E and b not in (0x2E, 0x5C) else f"\\{b:03d}"
                for b in label
            )
        )
    return (".".join(out) or ".")[:300]


_HEADER = struct.Struct("!HHHHHH")
_QTAIL = struct.Struct("!HH")
_RR_FIXED = struct.Struct("!HHIH")  # type, class, ttl, rdlength
_NO_OPT = (PLAIN_UDP_SIZE, 0, False)  # udp_size, EDNS version, DO of a query without OPT


def parse_query(data: bytes) -> Query:
    """Parse one query message; raises Malformed for anything we cannot answer at all."""
    if len(data) < 12:
        raise Malformed("shorter than a DNS header")
    fast = parse_query_fast(data)
    if fast is not None:
        return fast
    return parse_query_dnslib(data)


def _fast_qname(data: bytes, n: int) -> tuple[list[bytes], int] | None:
    """The question name's labels (uncompressed only) and the offset just past its root
    label, or None when it is not plain or runs past the message."""
    pos = 12
    labels: list[bytes] = []
    while True:
        if pos >= n:
            return None
        ln = data[pos]
        if ln == 0:
            return labels, pos + 1
        if ln > 63 or pos + 1 + ln > n:
            return None
        labels.append(bytes(data[pos + 1 : pos + 1 + ln]))
        pos += 1 + ln


def _fast_opt(data: bytes, qend: int, n: int) -> tuple[int, int, bool] | None:
    """The one additional record as an OPT with the root owner ending the message:
    (udp_size, EDNS version, DO bit), or None for anything else."""
    if qend + 11 > n or data[qend] != 0:
        return None
    rtype, rclass, ttl, rdlen = _RR_FIXED.unpack_from(data, qend + 1)
    if rtype != TYPE_OPT or qend + 11 + rdlen != n:
        return None
    return max(PLAIN_UDP_SIZE, rclass), (ttl >> 16) & 0xFF, bool(ttl & 0x8000)


def parse_query_fast(data: bytes) -> Query | None:
    """The common shape only (one question, no answer/authority, at most one OPT record
    ending the message); None means "take the dnslib path", never "malformed"."""
    n = len(data)
    if n < 17 or n > 4096:
        return None
    qid, flags, qd, an, ns, ar = _HEADER.unpack_from(data)
    if flags & 0x8000 or qd != 1 or an or ns or ar > 1:
        return None
    qname = _fast_qname(data, n)
    if qname is None:
        return None
    labels, pos = qname
    if pos - 12 > 255 or pos + 4 > n:
        return None
    qtype, qclass = _QTAIL.unpack_from(data, pos)
    qend = pos + 4
    opt: tuple[int, int, bool] | None = _NO_OPT
    if ar:
        opt = _fast_opt(data, qend, n)
        if opt is None:
            return None
    elif qend != n:
        return None
    udp_size, version, do = opt
    return Query(
        id=qid,
        labels=tuple(labels),
        qtype=qtype,
        qclass=qclass,
        rd=bool(flags & 0x0100),
        opcode=(flags >> 11) & 0xF,
        qdcount=1,
        edns=bool(ar),
        edns_version=version,
        udp_size=udp_size,
        do=do,
        question_wire=bytes(data[12:qend]),
    )


# records a query may carry past its one question (OPT, TSIG, ...): each costs a name's
# decoding, bounded in wirenames.py; past this many the message is not a query we answer,
# and past one question only the first is decoded (a message of thousands of names, each
# behind a pointer chain, took dnslib seconds)
MAX_QUERY_RECORDS = 8


def parse_query_dnslib(data: bytes) -> Query:
    if len(data) < 12:
        raise Malformed("shorter than a DNS header")
    try:
        rec, qdcount = parse_message(data, MAX_QUERY_RECORDS)
    except Exception as e:  # dnslib raises many types on hostile input; all mean the same
        raise Malformed("unparseable message") from e
    h = rec.header
    if h.qr:
        raise Malformed("a response, not a query")
    if not rec.questions:
        raise Malformed("no question")
    q = rec.questions[0]
    edns = False
    version = 0
    udp_size = PLAIN_UDP_SIZE
    do = False
    for rr in rec.ar:
        if rr.rtype == TYPE_OPT:
            edns = True
            udp_size = max(PLAIN_UDP_SIZE, min(int(rr.rclass), MAX_TCP_SIZE))
            version = (int(rr.ttl) >> 16) & 0xFF
            do = bool(int(rr.ttl) & 0x8000)
            break
    return Query(
        id=h.id,
        labels=tuple(bytes(x) for x in q.qname.label),
        qtype=int(q.qtype),
        qclass=int(q.qclass),
        rd=bool(h.rd),
        opcode=int(h.opcode),
        qdcount=qdcount,
        edns=edns,
        edns_version=version,
        udp_size=udp_size,
        do=do,
    )


@dataclass(frozen=True, slots=True)
class Record:
    owner: str | None  # presentation name; None = the question name as received
    rtype: str  # "A", "AAAA", "CNAME"
    ttl: int
    value: str  # address text or target name


@dataclass(frozen=True, slots=True)
class Reply:
    rcode: int
    answers: tuple[Record, ...] = field(default=())


_RDATA = {"A": A, "AAAA": AAAA, "CNAME": CNAME}


def build_response(
    q: Query, reply: Reply, max_size: int, edns_payload: int = 1232
) -> tuple[bytes, bool]:
    """Encode `reply` for `q`; returns (bytes, truncated). Never longer than max_size
    (an answer that does not fit drops its records and sets TC)."""
    # the root name is one byte on the wire, shorter than a compression pointer: dnslib
    # writes it inline, so the fast path (always a pointer) only serves non-root names
    if q.labels and all(r.owner is None and r.rtype in _ADDR_TYPES for r in reply.answers):
        return build_response_fast(q, reply, max_size, edns_payload)
    return build_response_dnslib(q, reply, max_size, edns_payload)


_ADDR_TYPES = {"A": (1, 4), "AAAA": (28, 16)}


def _question_wire(q: Query) -> bytes:
    if q.question_wire is not None:
        return q.question_wire
    name = b"".join(bytes((len(label),)) + label for label in q.labels) + b"\x00"
    return name + _QTAIL.pack(q.qtype, q.qclass)


@lru_cache(maxsize=4096)
def _packed(addr: str) -> bytes:
    return ipaddress.ip_address(addr).packed


def build_response_fast(
    q: Query, reply: Reply, max_size: int, edns_payload: int = 1232
) -> tuple[bytes, bool]:
    """Address-only answers owned by the question name (compression pointer 0xC00C)."""
    flags = 0x8000 | (q.opcode & 0xF) << 11 | (0x0100 if q.rd else 0) | 0x0080 | reply.rcode & 0xF
    question = _question_wire(q)
    # extended rcodes (BADVERS) keep their upper bits in the OPT record's TTL field
    ext = (reply.rcode >> 4) << 24
    opt = b"\x00" + _RR_FIXED.pack(TYPE_OPT, edns_payload, ext, 0) if q.edns else b""
    records = []
    for r in reply.answers:
        rtype, size = _ADDR_TYPES[r.rtype]
        packed = _packed(r.value)
        if len(packed) != size:
            raise ValueError(f"{r.value} is not an {r.rtype} address")
        records.append(b"\xc0\x0c" + _RR_FIXED.pack(rtype, CLASS_IN, r.ttl, size) + packed)
    ar = 1 if q.edns else 0
    data = b"".join((_HEADER.pack(q.id, flags, 1, len(records), 0, ar), question, *records, opt))
    if len(data) <= max_size:
        return data, False
    data = _HEADER.pack(q.id, flags | 0x0200, 1, 0, 0, ar) + question + opt
    if len(data) > max_size:
        data = _HEADER.pack(q.id, flags | 0x0200, 0, 0, 0, 0)
    return data, True


def build_response_dnslib(
    q: Query, reply: Reply, max_size: int, edns_payload: int = 1232
) -> tuple[bytes, bool]:
    h = DNSHeader(id=q.id, qr=1, aa=0, ra=1, rd=int(q.rd), opcode=q.opcode, rcode=reply.rcode)
    msg = DNSRecord(h, q=DNSQuestion(q.qname, q.qtype, q.qclass))
    for r in reply.answers:
        rtype = getattr(QTYPE, r.rtype)
        owner = q.qname if r.owner is None else DNSLabel(r.owner)
        msg.add_answer(RR(owner, rtype, rdata=_RDATA[r.rtype](r.value), ttl=r.ttl))
    if q.edns:
        msg.add_ar(EDNS0(udp_len=edns_payload))
    data = bytes(msg.pack())
    if len(data) <= max_size:
        return data, False
    msg.rr = []
    msg.header.tc = 1
    data = bytes(msg.pack())
    if len(data) > max_size:  # a question that alone exceeds the buffer: header only
        msg.questions = []
        msg.ar = []
        data = bytes(msg.pack())
    return data, True


def build_error(data: bytes, rcode: int) -> bytes | None:
    """A header-only error reply (FORMERR/NOTIMP) for a message whose header parsed but
    whose body we refuse; None when even the header is unusable."""
    if len(data) < 12:
        return None
    try:
        h = DNSHeader.parse(Buffer(data))
    except Exception:
        return None
    if h.qr:
        return None
    out = DNSHeader(id=h.id, qr=1, opcode=h.opcode, rd=h.rd, ra=1, rcode=rcode)
    return bytes(DNSRecord(out).pack())


def rcode_name(rcode: int) -> str:
    if rcode == 16:
        return "BADVERS"  # extended rcode, unknown to dnslib's 4-bit table
    try:
        return str(RCODE[rcode])
    except Exception:
        return f"RCODE{rcode}"
