"""The fake internet's authoritative DNS zone: a pure `query bytes -> reply bytes` core.

Hand-written on top of dnslib's wire codec (not dnslib's threaded server) because the
trap names need behaviour no stock server has: answers that alternate on successive
queries (rebinding), deliberate delays (upstream timeouts) and wildcard NXDOMAIN
subtrees. The asyncio shell in `serve.py` only moves bytes and honours the delay.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dnslib import AAAA, CNAME, QTYPE, RCODE, RR, TXT, A, DNSError, DNSRecord

from stockade.testing.testnet.layout import IPV6_NAME, WILDCARD_SITES, Layout

DEFAULT_TTL = 60
SLOW_DELAY = 5.0
SUPPORTED_TYPES = ("A", "AAAA", "CNAME", "TXT")
_MAX_CNAME_CHAIN = 8


@dataclass(frozen=True)
class Record:
    rtype: str  # one of SUPPORTED_TYPES
    value: str
    ttl: int = DEFAULT_TTL

    def __post_init__(self) -> None:
        if self.rtype not in SUPPORTED_TYPES:
            raise ValueError(f"unsupported record type {self.rtype!r}")
        if self.rtype == "A":
            ipaddress.IPv4Address(self.value)
        elif self.rtype == "AAAA":
            ipaddress.IPv6Address(self.value)
        elif self.rtype == "CNAME":
            _norm(self.value)

    def rdata(self) -> A | AAAA | CNAME | TXT:
        if self.rtype == "A":
            return A(self.value)
        if self.rtype == "AAAA":
            # packed: dnslib's text parser cannot read dotted-quad forms like ::ffff:a.b.c.d
            return AAAA(tuple(ipaddress.IPv6Address(self.value).packed))
        if self.rtype == "CNAME":
            return CNAME(self.value)
        return TXT(self.value)


@dataclass(frozen=True)
class Answer:
    rcode: str  # "NOERROR" | "NXDOMAIN" | "REFUSED"
    records: tuple[tuple[str, Record], ...] = ()
    delay: float = 0.0


def _norm(name: str) -> str:
    n = name.strip().rstrip(".").lower()
    if not n:
        raise ValueError("empty name")
    return n


@dataclass
class ZoneSpec:
    """Serializable description of the zone (travels in the serve spec as JSON)."""

    records: dict[str, list[Record]] = field(default_factory=dict)
    rotating: dict[str, list[str]] = field(default_factory=dict)  # name -> A values, TTL 0
    delays: dict[str, float] = field(default_factory=dict)  # name -> seconds before answering
    nxdomain_suffixes: list[str] = field(default_factory=list)  # "tunnel.test" covers *.tunnel.test
    # every name under the suffix answers with the records of the named host (a zone that
    # answers any name: wildcard tunnels that resolve)
    answer_all: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "records": {
                n: [[r.rtype, r.value, r.ttl] for r in rs] for n, rs in self.records.items()
            },
            "rotating": self.rotating,
            "delays": self.delays,
            "nxdomain_suffixes": self.nxdomain_suffixes,
            "answer_all": self.answer_all,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ZoneSpec:
        recs = data.get("records", {})
        assert isinstance(recs, dict)
        return cls(
            records={n: [Record(t, v, int(ttl)) for t, v, ttl in rs] for n, rs in recs.items()},
            rotating=dict(data.get("rotating", {})),  # type: ignore[call-overload]
            delays={k: float(v) for k, v in dict(data.get("delays", {})).items()},  # type: ignore[call-overload]
            nxdomain_suffixes=list(data.get("nxdomain_suffixes", [])),  # type: ignore[call-overload]
            answer_all=dict(data.get("answer_all", {})),  # type: ignore[call-overload]
        )


def default_zone(
    layout: Layout,
    extra_records: Mapping[str, Iterable[Record | tuple[str, str] | tuple[str, str, int]]]
    | None = None,
    slow_delay: float = SLOW_DELAY,
) -> ZoneSpec:
    """The standard names, trap names and any extra records for one layout."""
    allowed = layout.addresses["allowed.test"]
    embedded = ipaddress.IPv4Address(allowed).packed
    recs: dict[str, list[Record]] = {
        name: [Record("A", ip)] for name, ip in layout.addresses.items()
    }
    recs.update(
        {
            IPV6_NAME: [Record("AAAA", layout.ipv6_address)],
            "raw.test": [Record("A", layout.raw_echo_ip)],
            "ns.test": [Record("A", layout.dns_server)],
            "private.test": [Record("A", "10.0.0.5")],
            "metadata.test": [Record("A", "169.254.169.254")],
            "loopback.test": [Record("A", "127.0.0.1")],
            "cgnat.test": [Record("A", "100.64.0.7")],
            "mapped.test": [Record("AAAA", f"::ffff:{allowed}")],
            # RFC 6052 well-known prefix with the allowed address in the low 32 bits
            "nat64.test": [
                Record("AAAA", str(ipaddress.IPv6Address(b"\x00d\xff\x9b" + b"\0" * 8 + embedded)))
            ],
            "mixed.test": [Record("A", allowed), Record("A", "10.0.0.5")],
            "cname.test": [Record("CNAME", "allowed.test")],
            "cname-bad.test": [Record("CNAME", "denied.test")],
            "txt.test": [Record("TXT", "stockade fake internet txt record")],
            "slow.test": [Record("A", allowed)],
        }
    )
    for name, items in (extra_records or {}).items():
        n = _norm(name)
        for item in items:
            rec = item if isinstance(item, Record) else Record(*item)
            recs.setdefault(n, []).append(rec)
    return ZoneSpec(
        records=recs,
        rotating={"rebind.test": [allowed, "127.0.0.1"]},
        delays={"slow.test": slow_delay},
        nxdomain_suffixes=["tunnel.test"],
        # wild.test: a zone that answers any name; the wildcard sites under many names
        answer_all={"wild.test": "allowed.test", **{s: s for s in WILDCARD_SITES}},
    )


class Zone:
    """Answers queries for a ZoneSpec. Thread-safe; keeps only the rebinding counters."""

    def __init__(self, spec: ZoneSpec, on_query: Callable[[str, str], None] | None = None) -> None:
        self._records = {_norm(n): list(rs) for n, rs in spec.records.items()}
        self._answer_all = {_norm(s): _norm(n) for s, n in spec.answer_all.items()}
        self._on_query = on_query  # (name, qtype) of every parsed query: the query log
        self._rotating = {_norm(n): list(v) for n, v in spec.rotating.items()}
        self._delays = {_norm(n): d for n, d in spec.delays.items()}
        self._nx = tuple(_norm(s) for s in spec.nxdomain_suffixes)
        self._counters: dict[str, int] = {}
        self._lock = threading.Lock()

    def _exists(self, name: str) -> bool:
        if any(name == s or name.endswith("." + s) for s in self._nx):
            return False
        return name in self._records or name in self._rotating or self._stand_in(name) is not None

    def _stand_in(self, name: str) -> str | None:
        """The host whose records answer `name` under an answer-all suffix, or None."""
        for suffix, host in self._answer_all.items():
            if name.endswith("." + suffix):
                return host
        return None

    def _own(self, name: str, qtype: str) -> list[Record]:
        stand_in = self._stand_in(name)
        if stand_in is not None and name not in self._records:
            return [r for r in self._records.get(stand_in, []) if qtype in ("ANY", r.rtype)]
        if name in self._rotating:
            if qtype not in ("A", "ANY"):
                return []
            values = self._rotating[name]
            with self._lock:
                i = self._counters.get(name, 0)
                self._counters[name] = i + 1
            return [Record("A", values[i % len(values)], 0)]
        return [r for r in self._records.get(name, []) if qtype == "ANY" or r.rtype == qtype]

    def resolve(self, qname: str, qtype: str) -> Answer:
        """Records answering (qname, qtype), following CNAMEs inside the zone."""
        try:
            name = _norm(qname)
        except ValueError:
            return Answer("REFUSED")
        delay = self._delays.get(name, 0.0)
        out: list[tuple[str, Record]] = []
        for _ in range(_MAX_CNAME_CHAIN):
            if not self._exists(name):
                return Answer("NXDOMAIN", tuple(out), delay)
            cnames = [r for r in self._records.get(name, []) if r.rtype == "CNAME"]
            if cnames and qtype != "CNAME":
                out.append((name, cnames[0]))
                name = _norm(cnames[0].value)
                continue
            out.extend((name, r) for r in self._own(name, qtype))
            return Answer("NOERROR", tuple(out), delay)
        return Answer("NOERROR", tuple(out), delay)  # CNAME loop: stop where we are

    def respond(self, query: bytes) -> tuple[bytes | None, float]:
        """Reply bytes for one DNS message (None: not a parsable query, drop it) and the
        delay the shell must wait before sending them."""
        try:
            request = DNSRecord.parse(query)
        except (DNSError, ValueError, IndexError, UnicodeDecodeError):
            return None, 0.0
        if request.header.qr or len(request.questions) != 1:
            return None, 0.0
        q = request.questions[0]
        qname = str(q.qname)
        qtype = str(QTYPE.get(q.qtype, str(q.qtype)))
        if self._on_query is not None:
            self._on_query(qname.rstrip(".").lower(), qtype)
        ans = self.resolve(qname, qtype)
        reply = request.reply()
        reply.header.rcode = getattr(RCODE, ans.rcode)
        for owner, rec in ans.records:
            reply.add_answer(RR(owner, getattr(QTYPE, rec.rtype), rdata=rec.rdata(), ttl=rec.ttl))
        return bytes(reply.pack()), ans.delay


def records_from(items: Sequence[tuple[str, str]]) -> list[Record]:
    return [Record(t, v) for t, v in items]
