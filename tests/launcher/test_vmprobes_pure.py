"""The microVM self-test's probe program (launcher/guest_probes.py) and its host side
(launcher/vmprobes.py): what it sends is what the gateway and the DNS firewall parse, its
report is read back into the verdict's observations, and run on this host's Python
(as the guest's is: `-I -S`, builtins only) against local listeners it reports the
outcomes the other tiers' runner does."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import dns.message
import pytest
from stockade.gateway.sniff_tls import ClientHello, TlsSniffer
from stockade.launcher import guest_probes, vmprobes
from stockade.launcher.probes import ProbeSetupError
from stockade.launcher.selftest import DNS_DENIED, REFUSED, Probe


def test_the_client_hello_is_one_the_gateway_parses() -> None:
    named = TlsSniffer().feed(guest_probes.client_hello("tls.t1.stockade-fence-probe.invalid"))
    assert isinstance(named, ClientHello) and named.sni == "tls.t1.stockade-fence-probe.invalid"
    nameless = TlsSniffer().feed(guest_probes.client_hello(None))
    assert isinstance(nameless, ClientHello) and nameless.sni is None


def test_the_dns_query_is_one_dnspython_parses() -> None:
    q = dns.message.from_wire(guest_probes.dns_query("dns.t1.stockade-fence-probe.invalid"))
    assert str(q.question[0].name) == "dns.t1.stockade-fence-probe.invalid."
    assert q.question[0].rdtype == 1 and q.flags & dns.flags.RD


def test_the_report_is_read_back_and_bad_fields_are_refused() -> None:
    probes = [Probe("udp", "udp", "192.0.2.1", 443, REFUSED), Probe("x", "dns", "1.2.3.4", 53,
                                                                    DNS_DENIED, "a.invalid")]
    out = b"udp\ttimeout\t40001\ttimed out\nudp\treply\t1\tagain\nother\tx\t1\t\nbroken line\n"
    seen = vmprobes.observations(out, probes)
    assert list(seen) == ["udp"]  # the first line of a probe; the unknown one is dropped
    assert (seen["udp"].outcome, seen["udp"].source_port) == ("timeout", 40001)
    req = vmprobes.request("/usr/bin/python3", probes, 2.0)
    assert req.argv[:3] == ("/usr/bin/python3", "-I", "-S") and req.argv[-1] == \
        "x|dns|1.2.3.4|53|a.invalid"
    with pytest.raises(ProbeSetupError, match="cannot be sent"):
        vmprobes.request("/usr/bin/python3", [Probe("y|z", "udp", "1.2.3.4", 1, REFUSED)], 1)


@pytest.fixture
def listeners() -> Iterator[dict[str, int]]:
    """A gateway-like HTTP refusal, a TLS server that closes, and a DNS refusal."""
    http, tls = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))

    def serve_http() -> None:
        c, _ = http.accept()
        c.recv(4096)
        c.sendall(b"HTTP/1.1 403 Forbidden\r\nX-Stockade-Deny: no_matching_rule\r\n\r\n")
        c.close()

    def serve_tls() -> None:
        c, _ = tls.accept()
        c.recv(4096)
        c.sendall(b"\x15\x03\x03\x00\x02\x02\x28")  # a handshake_failure alert
        c.close()

    def serve_dns() -> None:
        data, peer = udp.recvfrom(512)
        reply = dns.message.make_response(dns.message.from_wire(data))
        reply.set_rcode(dns.rcode.REFUSED)
        udp.sendto(reply.to_wire(), peer)

    threads = [threading.Thread(target=f, daemon=True) for f in (serve_http, serve_tls,
                                                                  serve_dns)]
    for t in threads:
        t.start()
    yield {"http": http.getsockname()[1], "tls": tls.getsockname()[1],
           "dns": udp.getsockname()[1]}
    for s in (http, tls, udp):
        s.close()


def test_the_program_reports_what_the_host_side_runner_would(listeners: dict[str, int]) -> None:
    probes = [Probe("h", "http", "127.0.0.1", listeners["http"], REFUSED, "host.invalid"),
              Probe("t", "tls", "127.0.0.1", listeners["tls"], REFUSED, "tls.invalid"),
              Probe("d", "dns", "127.0.0.1", listeners["dns"], DNS_DENIED, "dns.invalid"),
              Probe("u", "udp", "127.0.0.1", 9, REFUSED | {"timeout"}),
              Probe("c", "http", "127.0.0.1", 1, REFUSED)]
    req = vmprobes.request(sys.executable, probes, 2.0)
    proc = subprocess.run(req.argv, capture_output=True, timeout=60, check=True)
    seen = vmprobes.observations(proc.stdout, probes)
    assert {n: o.outcome for n, o in seen.items()} == {
        "h": "denied:no_matching_rule", "t": "closed", "d": "answer:REFUSED",
        "u": "refused", "c": "refused"}, proc.stdout  # (a local port answers ICMP)
    assert all(o.source_port for n, o in seen.items() if n != "c")


def test_a_probed_one_shot_guest_serves_its_agent_first() -> None:
    from stockade.launcher import microvm

    common = dict(argv=["true"], env={}, uid=1000, gid=1000, rlimits={}, guest_ip="10.0.0.2",
                  host_ip="10.0.0.1", prefixlen=30, memory=1, pids=1, pids_fail_kill=1,
                  stdin=False, cpus=1.0, session_modules=[("m", "")])
    first = microvm.guest_plan(**common, probe_first=True)  # type: ignore[arg-type]
    assert (first["session"], first["probe_first"], first["argv"]) == (False, True, ["true"])
    session = microvm.guest_plan(**common)  # type: ignore[arg-type]
    assert (session["session"], session["probe_first"]) == (True, False)
