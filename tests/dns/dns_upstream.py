"""A real upstream DNS server for the DNS tests: dnslib's threaded UDP+TCP server on a
loopback address, serving a small zone with the behaviours the tests need (TTL 0,
CNAME chains, SERVFAIL, silence, big answers, forbidden addresses).

Used until/alongside `stockade.testing.testnet.FakeInternet`; it only ever binds 127.0.0.0/8.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field

from dnslib import AAAA, CNAME, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer, TCPServer, UDPServer

from stockade.lifecycle import StartStop


@dataclass
class Zone:
    a: dict[str, list[str]] = field(default_factory=dict)
    aaaa: dict[str, list[str]] = field(default_factory=dict)
    cname: dict[str, str] = field(default_factory=dict)
    ttl: dict[str, int] = field(default_factory=dict)
    servfail: set[str] = field(default_factory=set)
    silent: set[str] = field(default_factory=set)  # never answered (timeouts)
    wildcard_suffix: set[str] = field(default_factory=set)  # any label under it -> 1.2.3.4 style


def default_zone() -> Zone:
    z = Zone()
    z.a["allowed.test"] = ["93.184.216.34"]
    z.aaaa["allowed.test"] = ["2606:2800:220:1:248:1893:25c8:1946"]
    z.a["other.test"] = ["93.184.216.35"]
    z.a["www.allowed.test"] = ["93.184.216.36"]
    z.cname["alias.allowed.test"] = "mid.allowed.test"
    z.cname["mid.allowed.test"] = "allowed.test"
    z.cname["escape.allowed.test"] = "other.test"
    z.a["private.allowed.test"] = ["10.0.0.1", "93.184.216.40"]
    z.a["metadata.allowed.test"] = ["169.254.169.254"]
    z.aaaa["metadata.allowed.test"] = ["fd00:ec2::254", "::ffff:7f00:1"]
    z.a["rebind.allowed.test"] = ["93.184.216.41"]
    z.ttl["rebind.allowed.test"] = 0
    z.a["long-ttl.allowed.test"] = ["93.184.216.42"]
    z.ttl["long-ttl.allowed.test"] = 86400
    z.a["big.allowed.test"] = [f"93.184.{i // 250}.{i % 250 + 1}" for i in range(60)]
    z.servfail.add("broken.allowed.test")
    z.silent.add("slow.allowed.test")
    return z


class _ZoneResolver(BaseResolver):
    def __init__(self, zone: Zone, stop: threading.Event) -> None:
        self.zone = zone
        self.stop = stop
        self.queries: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        reply = request.reply()
        q = request.q
        name = str(q.qname).rstrip(".").lower()
        qtype = QTYPE[q.qtype]
        with self.lock:
            self.queries[(name, qtype)] += 1
        z = self.zone
        if name in z.silent:
            self.stop.wait(30)  # hold the handler thread: the client times out
            raise OSError("silent name")  # dnslib drops the reply on error
        if name in z.servfail:
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        cur = name
        for _ in range(10):
            if cur not in z.cname:
                break
            target = z.cname[cur]
            reply.add_answer(RR(cur, QTYPE.CNAME, rdata=CNAME(target), ttl=z.ttl.get(cur, 60)))
            cur = target
        ttl = z.ttl.get(cur, 60)
        known = cur in z.a or cur in z.aaaa or cur in z.cname
        if any(cur.endswith("." + s) for s in z.wildcard_suffix):
            known = True
            if qtype == "A":
                reply.add_answer(RR(cur, QTYPE.A, rdata=A("93.184.216.50"), ttl=ttl))
        if qtype in ("A", "ANY"):
            for ip in z.a.get(cur, []):
                reply.add_answer(RR(cur, QTYPE.A, rdata=A(ip), ttl=ttl))
        if qtype in ("AAAA", "ANY"):
            for ip in z.aaaa.get(cur, []):
                reply.add_answer(RR(cur, QTYPE.AAAA, rdata=AAAA(ip), ttl=ttl))
        if not known:
            reply.header.rcode = RCODE.NXDOMAIN
        return reply


class _Handler(DNSHandler):
    def handle(self) -> None:
        # a silent name or a stopped server: no reply, no traceback
        with contextlib.suppress(Exception):
            super().handle()


class _QuietLogger(DNSLogger):
    def __init__(self) -> None:
        super().__init__(log="-request,-reply,-truncated,-error,-recv,-send,-data", prefix=False)


class Upstream(StartStop):
    """dnslib UDP+TCP server on a random 127.x.y.z address and one port."""

    def __init__(self, zone: Zone | None = None) -> None:
        self.zone = zone or default_zone()
        self._stop = threading.Event()
        self.resolver = _ZoneResolver(self.zone, self._stop)
        self.address = (
            f"127.{random.randint(1, 254)}.{random.randint(0, 254)}.{random.randint(1, 254)}"
        )
        self.port = 0
        self._servers: list[DNSServer] = []

    @property
    def server(self) -> str:
        return f"{self.address}:{self.port}"

    def queries(self, name: str, qtype: str) -> int:
        with self.resolver.lock:
            return self.resolver.queries[(name, qtype)]

    def start(self) -> Upstream:
        for _ in range(50):
            udp = DNSServer(
                self.resolver,
                self.address,
                0,
                logger=_QuietLogger(),
                server=UDPServer,
                handler=_Handler,
            )
            port = udp.server.server_address[1]
            try:
                tcp = DNSServer(
                    self.resolver,
                    self.address,
                    port,
                    tcp=True,
                    logger=_QuietLogger(),
                    server=TCPServer,
                    handler=_Handler,
                )
            except OSError:
                udp.server.server_close()
                continue
            self.port = port
            self._servers = [udp, tcp]
            for s in self._servers:
                s.server.daemon_threads = True
                # a short poll interval keeps shutdown (and so each test's teardown) quick
                t = threading.Thread(
                    target=s.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
                )
                t.start()
            return self
        raise RuntimeError("no free port for the upstream DNS server")

    def stop(self) -> None:
        self._stop.set()
        for s in self._servers:
            s.server.shutdown()
            s.server.server_close()
        self._servers = []


def free_udp_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
