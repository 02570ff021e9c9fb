"""The inspector against request smuggling and path tricks (review findings, 2026-11).

An HTTP/1.1-only upstream that records every byte it receives stands behind the
inspector, so each test can say what the upstream never saw. mitmproxy (with h2 4.1.0)
accepts CR/LF/NUL inside HTTP/2 header values and :method/:path and would write them
verbatim to such an upstream; the inspector refuses those heads before deciding.

The gateway here runs with `inspection.upstream_first: false`: with it on (the default)
an HTTP/2 client of an HTTP/1.1-only upstream is offered HTTP/1.1 only, and no HTTP/2
head is ever rewritten for such an upstream (test_gw_inspection_upstream_first.py). With
it off that rewrite happens, and these tests guard it."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import ssl
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
import trustme
from gw_harness import GatewayHarness, registered_client, running_gateway
from stockade.gateway.inspector.handoff import FlowMeta, connect_request
from test_gw_inspection import _handoff, ca, find_event, l7_config

from stockade.testing.testnet import FakeInternet

pytestmark = pytest.mark.netns

UPSTREAM_IP = "127.79.0.1"

METHODS_ONLY = """\
profile: mo
description: a methods-only inspected entry (like npm-readonly)
egress:
  allow:
    - host: echo.test
      reason: read-only
      http: {methods: [GET, HEAD]}
"""


class RecordingUpstream:
    """HTTP/1.1 over TLS on `ip`:443 for echo.test: answers every request head with 200
    "ok" and keeps every byte it received (and counts the connections it accepted)."""

    def __init__(self, issuer: trustme.CA, ip: str = UPSTREAM_IP) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        issuer.issue_cert("echo.test").configure_cert(self.ctx)
        self.ctx.set_alpn_protocols(["http/1.1"])
        self.received = bytearray()
        self.accepted = 0
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, 443))
        self.sock.listen(50)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.accepted += 1
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            t = self.ctx.wrap_socket(c, server_side=True)
            buf = b""
            while True:
                d = t.recv(65536)
                if not d:
                    break
                with self.lock:
                    self.received += d
                buf += d
                while b"\r\n\r\n" in buf:
                    _, _, buf = buf.partition(b"\r\n\r\n")
                    t.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        except (OSError, ssl.SSLError):
            pass
        finally:
            c.close()

    def take(self) -> bytes:
        with self.lock:
            out = bytes(self.received)
            self.received.clear()
        return out

    def close(self) -> None:
        # close() alone leaves the port bound while _accept blocks in accept(): the
        # shutdown wakes it, so the next module's upstream can bind the same address
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.fixture(scope="module")
def upstream_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def upstream(upstream_ca: trustme.CA) -> Iterator[RecordingUpstream]:
    u = RecordingUpstream(upstream_ca)
    yield u
    u.close()


@pytest.fixture(scope="module")
def sgw(
    fake_internet: FakeInternet,
    tmp_path_factory: pytest.TempPathFactory,
    upstream_ca: trustme.CA,
    upstream: RecordingUpstream,
) -> Iterator[GatewayHarness]:
    tmp = tmp_path_factory.mktemp("smuggle")
    cfg = trusting_config(tmp, fake_internet, upstream_ca, upstream_first=False)
    (tmp / "rules" / "profiles" / "mo.yaml").write_text(METHODS_ONLY)
    with running_gateway(cfg, inspector=True) as h:
        yield h


def trusting_config(tmp: Path, fi: FakeInternet, issuer: trustme.CA, **inspection: Any) -> Path:
    """l7_config whose inspector trusts `issuer` (a recording upstream's CA) as well."""
    bundle = tmp / "bundle.pem"
    bundle.write_bytes(Path(fi.ca_pem).read_bytes() + issuer.cert_pem.bytes())
    return l7_config(tmp, fi, upstream_ca_file=str(bundle), **inspection)


def handed_off(
    gw: GatewayHarness, profile: str = "l7", ip: str = UPSTREAM_IP, task: str = "t-smuggle"
) -> tuple[socket.socket, int]:
    """A hand-off (as the gateway makes it) of echo.test at `ip`:443, before any TLS;
    returns the socket and the connection id."""
    conn = 800_000 + secrets.randbelow(99_999)
    m = FlowMeta(
        connection_id=conn,
        task_id=task,
        profile=profile,
        host="echo.test",
        ip=ip,
        port=443,
        policy_version=gw.svc.rules.current.version,  # type: ignore[union-attr]
    )
    sock, head = _handoff(gw, connect_request(m, gw.svc.inspector.key))  # type: ignore[union-attr]
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock, conn


def _tunnel(gw: GatewayHarness, alpn: str, profile: str = "l7") -> tuple[ssl.SSLSocket, int]:
    """A hand-off to the recording upstream, then TLS."""
    sock, conn = handed_off(gw, profile)
    ctx = ssl.create_default_context(cafile=ca(gw))
    ctx.set_alpn_protocols([alpn])
    t = ctx.wrap_socket(sock, server_hostname="echo.test")
    assert t.selected_alpn_protocol() == alpn
    return t, conn


def _h2(t: ssl.SSLSocket) -> h2.connection.H2Connection:
    c = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=True,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            header_encoding=None,
        )
    )
    c.initiate_connection()
    t.sendall(c.data_to_send())
    return c


def _h2_answer(
    t: ssl.SSLSocket,
    c: h2.connection.H2Connection,
    sid: int,
    headers: dict[bytes, bytes] | None = None,
) -> tuple[Any, bytes]:
    """The :status and body of stream `sid` (None if it was reset or the connection
    ended first); its response headers go into `headers` when given."""
    status: Any = None
    body = b""
    t.settimeout(10)
    while True:
        try:
            d = t.recv(65536)
        except (TimeoutError, ssl.SSLError, OSError):
            return status, body
        if not d:
            return status, body
        for ev in c.receive_data(d):
            if getattr(ev, "stream_id", None) != sid:
                continue
            if isinstance(ev, h2.events.ResponseReceived):
                status = dict(ev.headers)[b":status"]
                if headers is not None:
                    headers.update(ev.headers)
            elif isinstance(ev, h2.events.DataReceived):
                body += ev.data
                c.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                t.sendall(c.data_to_send())
                return status, body
        t.sendall(c.data_to_send())


def _h1_answer(t: ssl.SSLSocket) -> bytes:
    out = b""
    t.settimeout(10)
    try:
        while True:
            d = t.recv(65536)
            if not d:
                break
            out += d
    except (TimeoutError, ssl.SSLError, OSError):
        pass
    return out


def _req(method: bytes = b"GET", path: bytes = b"/allowed/x", *extra: tuple[bytes, bytes]) -> list:
    return [
        (b":method", method),
        (b":scheme", b"https"),
        (b":authority", b"echo.test"),
        (b":path", path),
        *extra,
    ]


SMUGGLED = (
    b"1\r\nContent-Length: 0\r\n\r\nPOST /upload/smuggled HTTP/1.1\r\nHost: echo.test\r\n"
    b"Content-Length: 11\r\n\r\nexfil-data!GET /allowed/pad HTTP/1.1\r\nHost: echo.test\r\nX: y"
)

H2_HEADS = {
    "crlf-in-value": _req(b"GET", b"/allowed/x", (b"x-a", SMUGGLED)),
    "lf-in-value": _req(b"GET", b"/allowed/x", (b"x-a", b"1\nx-injected: yes")),
    "cr-in-value": _req(b"GET", b"/allowed/x", (b"x-a", b"1\rx-injected: yes")),
    "nul-in-value": _req(b"GET", b"/allowed/x", (b"x-a", b"1\x00x")),
    "crlf-in-name": _req(b"GET", b"/allowed/x", (b"x-b\r\nx-injected", b"yes")),
    "space-in-name": _req(b"GET", b"/allowed/x", (b"x b", b"yes")),
    "leading-space-value": _req(b"GET", b"/allowed/x", (b"x-a", b" 1")),
    "trailing-tab-value": _req(b"GET", b"/allowed/x", (b"x-a", b"1\t")),
    "crlf-in-path": _req(b"GET", b"/allowed/x HTTP/1.1\r\nX: y"),
    "space-in-path": _req(b"GET", b"/allowed/x /upload"),
    "non-ascii-path": _req(b"GET", "/allowed/\u2025/x".encode()),
    "crlf-in-method": _req(b"GET /upload HTTP/1.1\r\nX:", b"/allowed/x"),
    "space-in-method": _req(b"GET /upload", b"/allowed/x"),
}


# h2 4.1.0 itself refuses whitespace around values: a connection error (GOAWAY, sent
# without mitmproxy's debug text)
H2_REFUSED_BY_H2 = {"leading-space-value", "trailing-tab-value"}


@pytest.mark.parametrize("case", sorted(H2_HEADS))
def test_h2_heads_that_could_smuggle_are_refused(
    sgw: GatewayHarness, upstream: RecordingUpstream, case: str
) -> None:
    upstream.take()
    t, conn = _tunnel(sgw, "h2")
    c = _h2(t)
    c.send_headers(1, H2_HEADS[case], end_stream=True)
    t.sendall(c.data_to_send())
    headers: dict[bytes, bytes] = {}
    status, body = _h2_answer(t, c, 1, headers)
    if case in H2_REFUSED_BY_H2:
        t.close()
        assert status is None
        assert upstream.take() == b""
        ev = find_event(sgw, "request_decision", stockade__connection_id=conn)
        assert ev["stockade"]["decision"] == "denied"
        assert ev["event"]["reason"] == "protocol_unrecognised"
        return
    # the same connection still serves a clean request (so the upstream was reachable)
    c.send_headers(3, _req(b"GET", b"/allowed/clean"), end_stream=True)
    t.sendall(c.data_to_send())
    clean, _ = _h2_answer(t, c, 3)
    t.close()
    seen = upstream.take()
    assert b"/allowed/x" not in seen and b"upload" not in seen and b"injected" not in seen, seen
    # the inspector's check (403) or mitmproxy's validation (400), both with Stockade's body
    assert status in (b"403", b"400"), (status, body)
    assert json.loads(body)["reason"] == "protocol_unrecognised"
    assert b"mitmproxy" not in body
    # mitmproxy's own error stream says text/html and names itself: ours is JSON
    assert headers[b"content-type"] == b"application/json", headers
    assert headers[b"x-stockade-deny"] == b"protocol_unrecognised", headers
    assert b"mitmproxy" not in headers.get(b"server", b""), headers
    assert clean == b"200"
    assert b"/allowed/clean" in seen
    evs = [e for e in sgw.events() if e["stockade"].get("connection_id") == conn]
    assert [(e["stockade"]["decision"], e["event"]["reason"]) for e in evs] == [
        ("denied", "protocol_unrecognised"),
        ("allowed", "allowed_by_rule"),
    ]


def test_h2_path_injection_under_a_methods_only_entry_is_refused(
    sgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    """A methods-only entry matches any path: the path's shape is still checked."""
    upstream.take()
    t, conn = _tunnel(sgw, "h2", profile="mo")
    c = _h2(t)
    c.send_headers(
        1,
        _req(
            b"GET",
            b"/x HTTP/1.1\r\nHost: echo.test\r\n\r\nDELETE /package/victim HTTP/1.1\r\nX: y",
        ),
        end_stream=True,
    )
    t.sendall(c.data_to_send())
    status, _ = _h2_answer(t, c, 1)
    c.send_headers(3, _req(b"GET", b"/@scope%2fname"), end_stream=True)  # npm's scoped name
    t.sendall(c.data_to_send())
    scoped, _ = _h2_answer(t, c, 3)
    t.close()
    assert status == b"403"
    assert scoped == b"200"
    seen = upstream.take()
    assert b"DELETE" not in seen and b"victim" not in seen, seen
    assert b"GET /@scope%2fname HTTP/1.1" in seen
    ev = find_event(
        sgw, "request_decision", stockade__connection_id=conn, stockade__decision="denied"
    )
    assert ev["event"]["reason"] == "protocol_unrecognised"


def test_h2_trailers_never_reach_the_upstream(
    sgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    upstream.take()
    t, conn = _tunnel(sgw, "h2")
    c = _h2(t)
    c.send_headers(1, _req(b"GET", b"/allowed/t"), end_stream=False)
    c.send_data(1, b"x")
    c.send_headers(1, [(b"x-trailer", b"1\r\nX-Injected: yes")], end_stream=True)
    t.sendall(c.data_to_send())
    _h2_answer(t, c, 1)
    t.close()
    assert b"injected" not in upstream.take().lower()
    ev = find_event(
        sgw, "request_decision", stockade__connection_id=conn, event__reason="protocol_unrecognised"
    )
    assert ev["stockade"]["decision"] == "denied" and "trailers" in ev["message"]


SMUGGLE_CLIENT = r"""
import socket, ssl, sys, json
import h2.connection, h2.config, h2.events
ip, cafile, smuggled = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
ctx = ssl.create_default_context(cafile=cafile); ctx.set_alpn_protocols(["h2"])
t = ctx.wrap_socket(socket.create_connection((ip, 443), timeout=10), server_hostname="echo.test")
c = h2.connection.H2Connection(h2.config.H2Configuration(
    client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False))
c.initiate_connection(); t.sendall(c.data_to_send())
out = {}
def req(sid, path, extra=()):
    c.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                         (b":authority", b"echo.test"), (b":path", path), *extra], end_stream=True)
    t.sendall(c.data_to_send())
    status, body = None, b""
    while True:
        d = t.recv(65536)
        if not d:
            break
        done = False
        for ev in c.receive_data(d):
            if getattr(ev, "stream_id", None) != sid:
                continue
            if isinstance(ev, h2.events.ResponseReceived):
                status = dict(ev.headers)[b":status"].decode()
            elif isinstance(ev, h2.events.DataReceived):
                body += ev.data; c.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                done = True
        t.sendall(c.data_to_send())
        if done:
            break
    out[path.decode()] = [status, body.decode("latin-1")]
req(1, b"/allowed/first", [(b"x-a", smuggled)])
req(3, b"/allowed/second")
print(json.dumps(out))
"""


def test_smuggling_through_the_gateway_is_refused(
    sgw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    """The reviewer's demonstration, from a sandbox namespace through the transparent
    listener: the head with CRLF in a value gets 403, the connection goes on serving."""
    with registered_client(sgw, "t-smug", "l7", "l7") as ns:
        r = ns.run(
            [
                sys.executable, "-c", SMUGGLE_CLIENT, fake_internet.addresses["echo.test"],
                ca(sgw), SMUGGLED.hex(),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["/allowed/first"][0] == "403"
        assert json.loads(out["/allowed/first"][1])["reason"] == "protocol_unrecognised"
        assert out["/allowed/second"][0] == "200"
        # the echo server saw only the clean request: no smuggled POST came back to us
        assert "smuggled" not in out["/allowed/second"][1]
        ev = find_event(
            sgw, "request_decision", labels__task_id="t-smug", url__path="/allowed/first"
        )
        assert ev["stockade"]["decision"] == "denied"
        assert ev["event"]["reason"] == "protocol_unrecognised"
        assert not [
            e
            for e in sgw.events()
            if e["event"]["action"] == "request_decision"
            and e.get("labels", {}).get("task_id") == "t-smug"
            and e.get("url", {}).get("path", "").startswith("/upload")
        ]


# -- a denied body is never read -------------------------------------------------------------


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_denied_h2_upload_without_length_is_answered_and_reset_unread(
    sgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    insp = sgw.svc.inspector  # type: ignore[union-attr]
    assert insp is not None and insp.pid
    before = _rss(insp.pid)
    upstream.take()
    t, conn = _tunnel(sgw, "h2")
    c = _h2(t)
    c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    t.sendall(c.data_to_send())
    c.send_headers(1, _req(b"POST", b"/elsewhere"), end_stream=False)  # no content-length
    t.sendall(c.data_to_send())
    chunk = b"A" * 16384
    sent, status, reset = 0, None, False
    t.settimeout(0.05)
    while sent < 48 * 2**20 and not reset:
        try:
            d = t.recv(65536)
        except (TimeoutError, ssl.SSLWantReadError):
            d = None
        if d == b"":
            break
        for ev in c.receive_data(d) if d else ():
            if isinstance(ev, h2.events.ResponseReceived):
                status = dict(ev.headers)[b":status"]
            elif isinstance(ev, h2.events.StreamReset | h2.events.StreamEnded):
                reset = reset or isinstance(ev, h2.events.StreamReset)
        if reset:
            break
        window = min(c.local_flow_control_window(1), 4 * len(chunk))
        try:
            for _ in range(window // len(chunk)):
                c.send_data(1, chunk)
                sent += len(chunk)
        except h2.exceptions.StreamClosedError:
            break
        t.sendall(c.data_to_send())
    t.close()
    assert status == b"403"
    after = _rss(insp.pid)
    assert after - before < 24 * 2**20, (before >> 20, after >> 20, sent >> 20)
    assert upstream.take() == b""
    ev = find_event(sgw, "request_decision", stockade__connection_id=conn)
    assert ev["event"]["reason"] == "method_not_allowed"


def test_a_denied_chunked_h1_upload_gets_403_and_the_connection_ends(
    sgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    upstream.take()
    t, conn = _tunnel(sgw, "http/1.1")
    t.sendall(
        b"POST /elsewhere HTTP/1.1\r\nHost: echo.test\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4000\r\n" + b"B" * 0x4000 + b"\r\n"
    )
    out = _h1_answer(t)  # the connection ends without the rest of the body being sent
    t.close()
    assert out.startswith(b"HTTP/1.1 403"), out[:200]
    assert b"method_not_allowed" in out
    assert upstream.take() == b""
    find_event(
        sgw, "request_decision", stockade__connection_id=conn, event__reason="method_not_allowed"
    )


# -- path tricks ---------------------------------------------------------------------------------

ESCAPES = [
    "/allowed/..;/upload",
    "/allowed/..%3B/upload",
    "/allowed/%252e%252e/upload",
    "/allowed/%c0%ae%c0%ae/upload",
    "/allowed/%u002e%u002e/upload",
]


@pytest.mark.parametrize("path", ESCAPES)
def test_ambiguous_paths_never_match_an_allow_glob(
    sgw: GatewayHarness, upstream: RecordingUpstream, path: str
) -> None:
    upstream.take()
    t, conn = _tunnel(sgw, "http/1.1")
    t.sendall(f"GET {path} HTTP/1.1\r\nHost: echo.test\r\nConnection: close\r\n\r\n".encode())
    out = _h1_answer(t)
    t.close()
    assert out.startswith(b"HTTP/1.1 403") and b"path_not_allowed" in out, out[:200]
    assert upstream.take() == b""
    find_event(
        sgw, "request_decision", stockade__connection_id=conn, event__reason="path_not_allowed"
    )


@pytest.mark.parametrize("path", ["/allowed/#/../../upload", "/allowed/\u2025/upload"])
def test_a_target_with_a_fragment_or_non_ascii_is_refused(
    sgw: GatewayHarness, upstream: RecordingUpstream, path: str
) -> None:
    upstream.take()
    t, conn = _tunnel(sgw, "http/1.1")
    t.sendall(
        b"GET " + path.encode() + b" HTTP/1.1\r\nHost: echo.test\r\nConnection: close\r\n\r\n"
    )
    out = _h1_answer(t)
    t.close()
    assert out.startswith((b"HTTP/1.1 403", b"HTTP/1.1 400")), out[:200]
    assert b"protocol_unrecognised" in out and b"mitmproxy" not in out, out
    assert upstream.take() == b""
    find_event(
        sgw, "request_decision", stockade__connection_id=conn, event__reason="protocol_unrecognised"
    )


def test_mitmproxys_error_page_never_reaches_the_sandbox(
    sgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    """Two different Content-Lengths: mitmproxy's parser refuses the head; the sandbox gets
    Stockade's 400 body (no Server: mitmproxy, no parser message) and there is an event."""
    upstream.take()
    t, conn = _tunnel(sgw, "http/1.1")
    t.sendall(
        b"GET /allowed/x HTTP/1.1\r\nHost: echo.test\r\nContent-Length: 3\r\n"
        b"Content-Length: 4\r\n\r\nabc"
    )
    out = _h1_answer(t)
    t.close()
    assert out.startswith(b"HTTP/1.1 400"), out[:300]
    _, _, body = out.partition(b"\r\n\r\n")
    assert b"mitmproxy" not in out.lower() and b"content-length header" not in out.lower(), out
    assert json.loads(body)["reason"] == "protocol_unrecognised"
    assert upstream.take() == b""
    ev = find_event(sgw, "request_decision", stockade__connection_id=conn)
    assert ev["event"]["reason"] == "protocol_unrecognised"
    assert ev["stockade"]["decision"] == "denied"


@pytest.mark.parametrize(
    "head", [b"NOT A REQUEST LINE\r\n\r\n", b"GET /allowed/x HTTP/1.1\r\nno colon here\r\n\r\n"]
)
def test_an_unparseable_h1_head_is_answered_and_logged(
    sgw: GatewayHarness, upstream: RecordingUpstream, head: bytes
) -> None:
    """mitmproxy's parser refuses the head before any flow exists: the sandbox gets
    Stockade's 400 and the SOC still gets a denial event for the connection."""
    upstream.take()
    t, conn = _tunnel(sgw, "http/1.1")
    t.sendall(head)
    out = _h1_answer(t)
    t.close()
    assert out.startswith(b"HTTP/1.1 400"), out[:300]
    assert b"mitmproxy" not in out.lower(), out
    assert upstream.take() == b""
    ev = find_event(sgw, "request_decision", stockade__connection_id=conn)
    assert ev["event"]["reason"] == "protocol_unrecognised"
    assert ev["stockade"]["decision"] == "denied"
    assert "unparseable HTTP/1 request head" in ev["message"]
