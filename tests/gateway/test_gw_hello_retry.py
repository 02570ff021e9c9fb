"""Fronting through a TLS HelloRetryRequest, end to end through the real gateway.

An uninspected TLS flow is decided on its first ClientHello; a server that answers with
a HelloRetryRequest gets a second ClientHello in plaintext, and a shared front-end
routes by its SNI. The gateway (relay_gate.py) holds every client byte after the first
hello until the server's first message is judged, and after a retry lets the second
hello through only when it names the decided host (no ECH, no IP literal).

The upstream is a scripted TCP server on 127.0.0.1 (`loopback.test` resolves there on
the fake internet's DNS): it reads the first hello, waits, records what else reached it
before answering, answers with a hand-built HRR or ServerHello, then records everything.
Clients speak through the explicit proxy (CONNECT), each test from its own 127.0.0.x
address registered as its own task."""

from __future__ import annotations

import contextlib
import itertools
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import trustme
from gw_harness import (
    GatewayHarness,
    connect_tunnel,
    fake_internet_config,
    newest_event,
    registered_client,
    running_gateway,
)
from gw_tlsgen import hello_with_sni, real_client_hello
from polling import wait_until
from stockade.gateway.sniff_common import NEED_MORE
from stockade.gateway.sniff_tls import TlsSniffer
from stockade.gateway.tls_retry import CCS_RECORD
from test_gw_tls_retry import HRR, SERVER_HELLO

from stockade.testing.testnet import FakeInternet

pytestmark = pytest.mark.netns

NAME = "loopback.test"
PROFILE = """\
profile: hrr
description: an uninspected TLS entry whose server may ask for a retry
egress:
  allow:
    - host: loopback.test
      ports: [{port}]
      reason: the scripted upstream on 127.0.0.1 (spliced after the SNI check)
"""
ANSWER_DELAY_S = 0.4  # how long the upstream waits before answering the first hello


@dataclass
class Seen:
    """One connection at the upstream."""

    before: bytes = b""  # the first hello and whatever else arrived before the answer
    after: bytearray = field(default_factory=bytearray)  # everything after the answer
    done: threading.Event = field(default_factory=threading.Event)


class ScriptedUpstream:
    """127.0.0.1:<port>: reads a ClientHello, waits `delay`, answers `answer`, then
    records all it receives; `reply` is sent once, when the first bytes after the answer
    came (the "rest of the handshake")."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answer, self.delay, self.reply = HRR, ANSWER_DELAY_S, b"server-flight"
        self.conns: list[Seen] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            seen = Seen()
            self.conns.append(seen)
            threading.Thread(target=self._serve, args=(c, seen), daemon=True).start()

    def _serve(self, c: socket.socket, seen: Seen) -> None:
        answer, delay, reply = self.answer, self.delay, self.reply
        try:
            c.settimeout(10)
            buf, sniffer = b"", TlsSniffer()
            while sniffer.feed(d := c.recv(65536)) is NEED_MORE and d:
                buf += d
            buf += d
            time.sleep(delay)
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                buf += c.recv(65536)  # what the gateway let through before the answer
            c.settimeout(10)
            seen.before = buf
            c.sendall(answer)
            while d := c.recv(65536):
                seen.after += d
                if reply:
                    c.sendall(reply)
                    reply = b""
        except OSError:
            pass
        finally:
            c.close()
            seen.done.set()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    u = ScriptedUpstream()
    yield u
    u.close()


@pytest.fixture(scope="module")
def hgw(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory,
    upstream: ScriptedUpstream,
) -> Iterator[GatewayHarness]:  # fmt: skip
    cfg = fake_internet_config(
        tmp_path_factory.mktemp("hrr"),
        fake_internet,
        {"hrr": PROFILE.format(port=upstream.port)},
        # reachable from a client namespace's redirect (the transparent test), as in
        # conftest.py's gateway; the clients of the other tests come from 127.0.0.x
        transparent_listen=["0.0.0.0:0"],
        proxy_listen=["127.0.0.1:0"],
        allow_addresses=[fake_internet.subnet, "127.0.0.1/32"],
        sniff_timeout_s=3.0,
        dns={"ttl_min_s": 0},
        inspection={"enabled": False},
    )
    with running_gateway(cfg) as h:
        yield h


_sources = itertools.count(10)


@pytest.fixture
def task(hgw: GatewayHarness) -> Iterator[tuple[str, str]]:
    """(task id, source address): a task of its own per test, so its events are its own."""
    n = next(_sources)
    task_id, address = f"t-hrr-{n}", f"127.0.0.{n}"
    hgw.register(task_id, address, "hrr")
    yield task_id, address
    hgw.control.deregister(task_id)


@pytest.fixture
def script(upstream: ScriptedUpstream) -> Iterator[ScriptedUpstream]:
    yield upstream
    upstream.answer, upstream.delay, upstream.reply = HRR, ANSWER_DELAY_S, b"server-flight"


def tunnel(gw: GatewayHarness, source: str, port: int) -> socket.socket:
    """A CONNECT tunnel to loopback.test:`port` through the explicit proxy, from `source`."""
    return connect_tunnel(("127.0.0.1", gw.port("proxy")), f"{NAME}:{port}", source)


def read_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        d = s.recv(n - len(out))
        assert d, f"closed after {len(out)} of {n} bytes"
        out += d
    return out


def closed(s: socket.socket) -> bool:
    """The gateway closed the connection (EOF or reset), reading what was still sent."""
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def upstream_conn(up: ScriptedUpstream, before: int) -> Seen:
    wait_until(lambda: len(up.conns) > before, 10, what="the upstream was never dialled")
    return up.conns[before]


def refused_events(gw: GatewayHarness, task_id: str, reason: str = "destination_mismatch") -> None:
    ev = newest_event(gw, "connection_decision", labels__task_id=task_id,
                      stockade__decision="denied")  # fmt: skip
    assert ev["event"]["reason"] == reason
    assert ev["stockade"]["phase"] == "hello_retry"
    assert ev["destination"]["domain"] == NAME and ev["message"].startswith("after a Hello")
    allowed = newest_event(gw, "connection_decision", labels__task_id=task_id,
                           stockade__decision="allowed")  # fmt: skip
    assert allowed["stockade"]["connection_id"] == ev["stockade"]["connection_id"]
    close = newest_event(gw, "connection_close", labels__task_id=task_id)
    assert close["event"]["reason"] == reason and close["stockade"]["decision"] == "denied"


@pytest.mark.parametrize("ccs", [True, False], ids=["ccs", "no-ccs"])
def test_a_second_hello_naming_the_same_host_reaches_the_upstream(
    hgw: GatewayHarness, task: tuple[str, str], script: ScriptedUpstream, ccs: bool
) -> None:
    first, second = real_client_hello(NAME), hello_with_sni("LoopBack.test.")
    n = len(script.conns)
    s = tunnel(hgw, task[1], script.port)
    s.sendall(first)
    assert read_exactly(s, len(HRR)) == HRR
    s.sendall((CCS_RECORD if ccs else b"") + second)
    assert read_exactly(s, len(script.reply)) == script.reply
    s.sendall(b"finished-and-data")
    seen = upstream_conn(script, n)
    want = (CCS_RECORD if ccs else b"") + second + b"finished-and-data"
    wait_until(lambda: bytes(seen.after) == want, 5, what=lambda: bytes(seen.after))
    assert seen.before == first
    s.close()


@pytest.mark.parametrize(
    ("second", "why"),
    [
        (hello_with_sni("other.test"), "names other.test"),
        (hello_with_sni(NAME, ech=True), "encrypted name"),  # (f)
        (hello_with_sni("127.0.0.1"), "IP literal"),
    ],
    ids=["other-sni", "ech", "ip-literal"],
)
def test_a_second_hello_naming_another_destination_is_refused(
    hgw: GatewayHarness, task: tuple[str, str], script: ScriptedUpstream, second: bytes,
    why: str,
) -> None:  # fmt: skip
    n = len(script.conns)
    s = tunnel(hgw, task[1], script.port)
    s.sendall(real_client_hello(NAME))
    assert read_exactly(s, len(HRR)) == HRR
    s.sendall(CCS_RECORD + second)
    assert closed(s)
    seen = upstream_conn(script, n)
    assert seen.done.wait(5), "the upstream connection was left open"
    assert bytes(seen.after) == b""  # not even the CCS reached it
    refused_events(hgw, task[0])
    ev = newest_event(hgw, "connection_decision", labels__task_id=task[0],
                      stockade__decision="denied")  # fmt: skip
    assert why in ev["message"]


def test_garbage_in_place_of_the_second_hello_is_refused(
    hgw: GatewayHarness, task: tuple[str, str], script: ScriptedUpstream
) -> None:
    n = len(script.conns)
    s = tunnel(hgw, task[1], script.port)
    s.sendall(real_client_hello(NAME))
    assert read_exactly(s, len(HRR)) == HRR
    s.sendall(CCS_RECORD + CCS_RECORD + b"\x17\x03\x03\x00\x05hello")
    assert closed(s)
    seen = upstream_conn(script, n)
    assert seen.done.wait(5) and bytes(seen.after) == b""
    refused_events(hgw, task[0], "protocol_unrecognised")


@pytest.mark.parametrize("at_once", [True, False], ids=["one-write", "before-the-answer"])
@pytest.mark.parametrize("same", [True, False], ids=["same-sni", "other-sni"])
def test_an_eager_second_hello_is_held_then_judged(
    hgw: GatewayHarness, task: tuple[str, str], script: ScriptedUpstream, at_once: bool,
    same: bool,
) -> None:  # fmt: skip
    """The client bets on a retry and sends its second hello before the server answered:
    with the first (read with it by the gateway), or a moment later (left in the kernel)."""
    first = real_client_hello(NAME)
    second = CCS_RECORD + hello_with_sni(NAME if same else "other.test")
    n = len(script.conns)
    s = tunnel(hgw, task[1], script.port)
    if at_once:
        s.sendall(first + second)
    else:
        s.sendall(first)
        time.sleep(0.1)
        s.sendall(second)
    seen = upstream_conn(script, n)
    if same:
        assert read_exactly(s, len(HRR) + len(script.reply)) == HRR + script.reply
        wait_until(lambda: bytes(seen.after) == second, 5, what=lambda: bytes(seen.after))
        s.close()
    else:  # refused (the HRR may or may not have reached the client first)
        assert closed(s)
        assert seen.done.wait(5) and bytes(seen.after) == b""
        refused_events(hgw, task[0])
    assert seen.before == first  # nothing after the first hello went up before the answer


@pytest.mark.parametrize("answer", ["server_hello", "alert"])
def test_without_a_retry_bytes_flow_both_ways_including_early_ones(
    hgw: GatewayHarness, task: tuple[str, str], script: ScriptedUpstream, answer: str
) -> None:
    """(d) A plain ServerHello (or an alert): client bytes sent early are held until it
    came, then forwarded, and the tunnel is a plain splice both ways."""
    script.answer = SERVER_HELLO if answer == "server_hello" else b"\x15\x03\x03\x00\x02\x02\x28"
    first = real_client_hello(NAME)
    n = len(script.conns)
    s = tunnel(hgw, task[1], script.port)
    s.sendall(first + b"early-bytes")
    assert read_exactly(s, len(script.answer)) == script.answer
    seen = upstream_conn(script, n)
    assert seen.before == first
    assert read_exactly(s, len(script.reply)) == script.reply
    s.sendall(b"-then-more" + bytes(range(256)) * 400)
    want = b"early-bytes-then-more" + bytes(range(256)) * 400
    wait_until(lambda: len(seen.after) >= len(want), 5, what=lambda: len(seen.after))
    assert bytes(seen.after) == want
    s.close()
    close = newest_event(hgw, "connection_close", labels__task_id=task[0])
    assert close["event"]["reason"] == "closed"
    assert close["source"]["bytes"] == len(first) + len(want)


@pytest.fixture(scope="module")
def tls_upstream() -> Iterator[tuple[int, trustme.CA]]:
    """A real TLS 1.3 server on 127.0.0.1 that supports only P-384 key shares: a client
    offering X25519 (OpenSSL's default) gets a real HelloRetryRequest. Echoes a line."""
    ca = trustme.CA()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert(NAME).configure_cert(ctx)
    ctx.set_ecdh_curve("secp384r1")
    lst = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                c, _ = lst.accept()
            except OSError:
                return
            with contextlib.suppress(OSError, ssl.SSLError), ctx.wrap_socket(
                c, server_side=True
            ) as t:
                t.sendall(b"echo:" + t.recv(100))

    threading.Thread(target=serve, daemon=True).start()
    yield lst.getsockname()[1], ca
    with contextlib.suppress(OSError):
        lst.shutdown(socket.SHUT_RDWR)
    lst.close()


def test_a_real_handshake_with_a_retry_completes(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory,
    tls_upstream: tuple[int, trustme.CA],
) -> None:  # fmt: skip
    port, ca = tls_upstream
    cfg = fake_internet_config(
        tmp_path_factory.mktemp("hrr-real"), fake_internet,
        {"hrr": PROFILE.format(port=port)},
        transparent_listen=["127.0.0.1:0"], proxy_listen=["127.0.0.1:0"],
        allow_addresses=[fake_internet.subnet, "127.0.0.1/32"], inspection={"enabled": False},
    )  # fmt: skip
    with running_gateway(cfg) as gw:
        gw.register("t-hrr-real", "127.0.0.1", "hrr")
        cctx = ssl.create_default_context()
        ca.configure_trust(cctx)
        with cctx.wrap_socket(tunnel(gw, "127.0.0.1", port), server_hostname=NAME) as t:
            assert t.version() == "TLSv1.3"
            t.sendall(b"hello through a retry")
            assert t.recv(100) == b"echo:hello through a retry"
        close = newest_event(gw, "connection_close", labels__task_id="t-hrr-real")
        assert close["event"]["reason"] == "closed"


# run inside a client namespace: its TCP to anywhere is redirected to the gateway's
# transparent listener, as a sandbox's is; prints the answer, how the gateway ended the
# connection and how many bytes came after the answer
TRANSPARENT_CLIENT = r"""
import socket, sys
ip, port, want = sys.argv[1], int(sys.argv[2]), int(sys.argv[5])
first, second = bytes.fromhex(sys.argv[3]), bytes.fromhex(sys.argv[4])
s = socket.create_connection((ip, port), timeout=10)
s.sendall(first)
got = b""
while len(got) < want and (d := s.recv(want - len(got))):
    got += d
s.sendall(second)
rest, how = b"", "eof"
try:
    while d := s.recv(65536):
        rest += d
except ConnectionResetError:
    how = "reset"
print(got.hex(), how, len(rest))
"""


def test_the_transparent_listener_refuses_another_name_after_a_retry(
    hgw: GatewayHarness, fake_internet: FakeInternet, script: ScriptedUpstream
) -> None:
    # the sandbox dials any address (here one of the fake internet's); the gateway decides
    # on the SNI, dials loopback.test's checked address, and judges the second hello
    anywhere = next(iter(fake_internet.addresses.values()))
    n = len(script.conns)
    with registered_client(hgw, "t-hrr-transparent", "hrr", tag="hrr") as ns:
        second = CCS_RECORD + hello_with_sni("other.test")
        r = ns.run([sys.executable, "-c", TRANSPARENT_CLIENT, anywhere, str(script.port),
                    real_client_hello(NAME).hex(), second.hex(), str(len(HRR))],
                   capture_output=True, text=True, timeout=40)  # fmt: skip
        assert r.returncode == 0, r.stderr
        got, _how, rest = r.stdout.split()
        assert (bytes.fromhex(got), rest) == (HRR, "0")
        seen = upstream_conn(script, n)
        assert seen.done.wait(5), "the upstream connection was left open"
        assert bytes(seen.after) == b""
        refused_events(hgw, "t-hrr-transparent")

