"""`inspection.upstream_first` (the default): once the client's SNI names the flow's
host, the inspector dials the checked address and finishes the upstream TLS before it
answers the client, so the client is offered only the ALPN the upstream chose.

Against an HTTP/1.1-only upstream that counts its connections: an HTTP/2-capable client
gets HTTP/1.1 and its requests share one upstream connection (with the setting off,
mitmproxy opens one per HTTP/2 request), an HTTP/2-only client gets no ALPN (and its
HTTP/2 bytes never reach the upstream), and a ClientHello naming another host is refused
before anything is dialled."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator

import pytest
import trustme
from gw_harness import GatewayHarness, running_gateway
from gw_harness import newest_event as find_event
from test_gw_inspection import ca
from test_gw_inspection_smuggling import (
    H2_HEADS,
    RecordingUpstream,
    _h1_answer,
    _h2,
    handed_off,
    trusting_config,
)

from stockade.testing.testnet import FakeInternet

pytestmark = pytest.mark.netns

# not the smuggling module's address: both modules' upstreams may be bound at once
UPSTREAM_IP = "127.79.0.2"


@pytest.fixture(scope="module")
def counted() -> Iterator[tuple[trustme.CA, RecordingUpstream]]:
    """The counting upstream and the CA that issued its certificate."""
    issuer = trustme.CA()
    u = RecordingUpstream(issuer, UPSTREAM_IP)
    yield issuer, u
    u.close()


@pytest.fixture(scope="module")
def upstream(counted: tuple[trustme.CA, RecordingUpstream]) -> RecordingUpstream:
    return counted[1]


@pytest.fixture(scope="module")
def ufgw(
    fake_internet: FakeInternet,
    tmp_path_factory: pytest.TempPathFactory,
    counted: tuple[trustme.CA, RecordingUpstream],
) -> Iterator[GatewayHarness]:
    # the setting is left at its default
    cfg = trusting_config(tmp_path_factory.mktemp("upfirst"), fake_internet, counted[0])
    with running_gateway(cfg, inspector=True) as h:
        yield h


def _handed_off(gw: GatewayHarness) -> tuple[socket.socket, int]:
    """A hand-off (as the gateway makes it) to the counting upstream, before any TLS."""
    return handed_off(gw, ip=UPSTREAM_IP, task="t-upfirst")


def _tls(gw: GatewayHarness, sock: socket.socket, alpn: list[str], sni: str) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=ca(gw))
    ctx.set_alpn_protocols(alpn)
    return ctx.wrap_socket(sock, server_hostname=sni)


def _get(t: ssl.SSLSocket, path: str) -> bytes:
    t.sendall(f"GET {path} HTTP/1.1\r\nHost: echo.test\r\n\r\n".encode())
    got = b""
    while not got.endswith(b"\r\n\r\nok"):
        chunk = t.recv(65536)
        assert chunk, got
        got += chunk
    return got


def test_an_h2_client_of_an_http1_upstream_gets_http1_over_one_upstream_connection(
    ufgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    before = upstream.accepted
    upstream.take()
    sock, _ = _handed_off(ufgw)
    with _tls(ufgw, sock, ["h2", "http/1.1"], "echo.test") as t:
        assert t.selected_alpn_protocol() == "http/1.1"
        for i in range(3):
            assert _get(t, f"/allowed/{i}").startswith(b"HTTP/1.1 200")
    seen = upstream.take()
    assert [f"GET /allowed/{i} HTTP/1.1".encode() in seen for i in range(3)] == [True] * 3
    assert upstream.accepted - before == 1


def test_an_h2_only_client_of_an_http1_upstream_gets_no_h2(
    ufgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    """The upstream chose no protocol of the client's offer, and mitmproxy mirrors that:
    no ALPN, so the tunnel is HTTP/1.x. HTTP/2 sent anyway (a smuggling head) is not
    HTTP/1 and never reaches the upstream: nothing is rewritten from HTTP/2."""
    upstream.take()
    sock, _ = _handed_off(ufgw)
    t = _tls(ufgw, sock, ["h2"], "echo.test")
    assert t.selected_alpn_protocol() is None
    c = _h2(t)
    c.send_headers(1, H2_HEADS["crlf-in-value"], end_stream=True)
    t.sendall(c.data_to_send())
    answer = _h1_answer(t)
    t.close()
    assert not answer.startswith(b"HTTP/1.1 200"), answer
    seen = upstream.take()
    assert b"/allowed/x" not in seen and b"smuggled" not in seen, seen


def test_a_client_hello_naming_another_host_is_refused_before_any_dial(
    ufgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    before = upstream.accepted
    sock, conn = _handed_off(ufgw)
    with pytest.raises((ssl.SSLError, OSError)):
        _tls(ufgw, sock, ["h2", "http/1.1"], "denied.test").close()
    sock.close()
    ev = find_event(ufgw, "request_decision", stockade__connection_id=conn)
    assert ev["event"]["reason"] == "destination_mismatch"
    assert ev["stockade"]["decision"] == "denied"
    assert upstream.accepted == before
