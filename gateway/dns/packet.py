"""DNS wire format in and out: parse one query, build one response. Pure, no sockets.

dnslib does the encoding; what is hand-written here is the hostile-input boundary (any
exception from the parser means "malformed", the shape of a query we accept is checked
explicitly) and the size discipline (a UDP answer never exceeds the client's advertised
buffer: the TC bit is set and the client retries over TCP).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    qname: DNSLabel  # as received (case preserved, echoed back for 0x20 clients)
    labels: tuple[bytes, ...]
    qtype: int
    qclass: int
    rd: bool
    opcode: int
    qdcount: int
    edns: bool
    edns_version: int = 0
    udp_size: int = PLAIN_UDP_SIZE  # the client's buffer for UDP answers
    do: bool = False

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


def parse_query(data: bytes) -> Query:
    """Parse one query message; raises Malformed for anything we cannot answer at all."""
    if len(data) < 12:
        raise Malformed("shorter than a DNS header")
    try:
        rec = DNSRecord.parse(data)
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
        qname=q.qname,
        labels=tuple(bytes(x) for x in q.qname.label),
        qtype=int(q.qtype),
        qclass=int(q.qclass),
        rd=bool(h.rd),
        opcode=int(h.opcode),
        qdcount=len(rec.questions),
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
    try:
        return str(RCODE[rcode])
    except Exception:
        return f"RCODE{rcode}"
