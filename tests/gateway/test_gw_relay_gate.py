"""The relay with a RetryGate on real connected sockets (loopback), copy and splice
modes: the client is not read before the server's first message is judged, a fragmented
answer is relayed while it is judged, a refused second hello never goes up, and the byte
counts stay exact. (End to end through the gateway: test_gw_hello_retry.py.)"""

from __future__ import annotations

import asyncio
import socket

import pytest
from gw_tlsgen import hello_with_sni, refragment
from stockade.gateway.relay import HelloRetryRefused, PipePool, Relay, RetryGate
from stockade.gateway.tls_retry import CCS_RECORD, RetryWatch
from stockade.policy.reasons import Reason
from test_gw_relay import MODES, _read_all, tcp_pair
from test_gw_tls_retry import HRR, SERVER_HELLO

FIRST = hello_with_sni("a.test")


def _gated(mode: str, early: bytes = b"") -> tuple[Relay, list[socket.socket], list[int]]:
    """A relay whose first bytes are FIRST; (relay, [client app, upstream server], counted)."""
    client_app, client_gw = tcp_pair()
    up_gw, up_srv = tcp_pair()
    counted: list[int] = []

    def count(n: int) -> bool:
        counted.append(n)
        return True

    relay = Relay(
        client_gw, up_gw, count_up=count, pool=PipePool() if mode == "splice" else None,
        on_activity=lambda: None, first=FIRST,
        gate=RetryGate(RetryWatch("a.test", 16384), early),
    )  # fmt: skip
    return relay, [client_app, up_srv, client_gw, up_gw], counted


async def _recv_exactly(loop: asyncio.AbstractEventLoop, s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        d = await asyncio.wait_for(loop.sock_recv(s, n - len(out)), 10)
        assert d
        out += d
    return out


def _nothing_waiting(s: socket.socket) -> bool:
    try:
        s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    return False


@pytest.mark.parametrize("mode", MODES)
async def test_a_fragmented_retry_then_the_same_host(mode: str) -> None:
    loop = asyncio.get_running_loop()
    relay, (app, srv, *rest), counted = _gated(mode, early=b"")
    task = asyncio.ensure_future(relay.run())
    assert await _recv_exactly(loop, srv, len(FIRST)) == FIRST
    await loop.sock_sendall(app, CCS_RECORD)  # before the answer: left unread
    hrr = refragment(HRR, 3)  # 1-3 byte records: judged over several peeks and reads
    for i in range(0, len(hrr), 7):
        await loop.sock_sendall(srv, hrr[i : i + 7])
        await asyncio.sleep(0.01)
        assert _nothing_waiting(srv)  # the client's bytes stay unread meanwhile
    assert await _recv_exactly(loop, app, len(hrr)) == hrr
    second = hello_with_sni("A.TEST")
    await loop.sock_sendall(app, second)
    want = CCS_RECORD + second
    assert await _recv_exactly(loop, srv, len(want)) == want
    await loop.sock_sendall(app, b"after")
    app.shutdown(socket.SHUT_WR)
    assert await asyncio.wait_for(_read_all(loop, srv), 10) == b"after"
    srv.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(task, 10)
    assert (relay.bytes_up, relay.bytes_down) == (len(FIRST) + len(want) + 5, len(hrr))
    assert sum(counted) == len(want) + 5  # the first bytes were counted by the gateway
    for s in (app, srv, *rest):
        s.close()


@pytest.mark.parametrize("mode", MODES)
async def test_a_refused_second_hello_never_goes_up(mode: str) -> None:
    loop = asyncio.get_running_loop()
    relay, (app, srv, *rest), _ = _gated(mode, early=CCS_RECORD)  # read with the first
    task = asyncio.ensure_future(relay.run())
    assert await _recv_exactly(loop, srv, len(FIRST)) == FIRST
    await loop.sock_sendall(srv, HRR)
    assert await _recv_exactly(loop, app, len(HRR)) == HRR
    await loop.sock_sendall(app, hello_with_sni("b.test"))
    with pytest.raises(HelloRetryRefused) as e:
        await asyncio.wait_for(task, 10)
    assert e.value.refused.reason == Reason.DESTINATION_MISMATCH
    for s in rest:
        s.close()  # what the gateway does
    assert await asyncio.wait_for(_read_all(loop, srv), 10) == b""
    for s in (app, srv):
        s.close()


@pytest.mark.parametrize("mode", MODES)
async def test_no_retry_releases_early_bytes_then_splices(mode: str) -> None:
    loop = asyncio.get_running_loop()
    relay, (app, srv, *rest), _ = _gated(mode, early=b"early")
    task = asyncio.ensure_future(relay.run())
    assert await _recv_exactly(loop, srv, len(FIRST)) == FIRST
    await asyncio.sleep(0.05)
    assert _nothing_waiting(srv)
    await loop.sock_sendall(srv, SERVER_HELLO + b"rest")
    assert await _recv_exactly(loop, app, len(SERVER_HELLO) + 4) == SERVER_HELLO + b"rest"
    assert await _recv_exactly(loop, srv, 5) == b"early"
    app.shutdown(socket.SHUT_WR)
    srv.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(task, 10)
    assert relay.bytes_up == len(FIRST) + 5
    for s in (app, srv, *rest):
        s.close()


@pytest.mark.parametrize("mode", MODES)
async def test_ends_without_an_answer_or_a_second_hello(mode: str) -> None:
    """The server closes before answering (nothing to watch), or the client gives up
    after a retry (its partial hello is dropped): the relay ends, no hang."""
    loop = asyncio.get_running_loop()
    relay, (app, srv, *rest), _ = _gated(mode)
    task = asyncio.ensure_future(relay.run())
    assert await _recv_exactly(loop, srv, len(FIRST)) == FIRST
    await loop.sock_sendall(srv, HRR)
    assert await _recv_exactly(loop, app, len(HRR)) == HRR
    await loop.sock_sendall(app, hello_with_sni("a.test")[:20])
    app.shutdown(socket.SHUT_WR)
    assert await asyncio.wait_for(_read_all(loop, srv), 10) == b""  # half-closed, nothing
    srv.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(task, 10)
    for s in (app, srv, *rest):
        s.close()

    relay, (app, srv, *rest), _ = _gated(mode, early=b"x")
    task = asyncio.ensure_future(relay.run())
    assert await _recv_exactly(loop, srv, len(FIRST)) == FIRST
    srv.shutdown(socket.SHUT_WR)
    assert await asyncio.wait_for(_read_all(loop, app), 10) == b""
    app.shutdown(socket.SHUT_WR)
    assert await asyncio.wait_for(_read_all(loop, srv), 10) == b"x"
    await asyncio.wait_for(task, 10)
    for s in (app, srv, *rest):
        s.close()
