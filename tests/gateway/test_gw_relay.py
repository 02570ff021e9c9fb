"""The relay on real connected sockets (loopback): splice and copy modes behave the same,
half-close propagates, the upload cap is exact."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from stockade.gateway.relay import PipePool, Relay, UploadLimit, splice_works


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    lst = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    for s in (a, b):
        s.setblocking(False)
    return a, b


MODES = [
    "copy",
    pytest.param(
        "splice", marks=pytest.mark.skipif(not splice_works(), reason="splice unavailable")
    ),
]


async def _read_all(loop: asyncio.AbstractEventLoop, s: socket.socket) -> bytes:
    out = bytearray()
    while chunk := await loop.sock_recv(s, 65536):
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("mode", MODES)
async def test_both_directions_and_half_close(mode: str) -> None:
    loop = asyncio.get_running_loop()
    client_app, client_gw = tcp_pair()  # the sandbox side
    up_gw, up_srv = tcp_pair()  # the upstream side
    pool = PipePool() if mode == "splice" else None
    relay = Relay(client_gw, up_gw, count_up=lambda n: True, pool=pool, on_activity=lambda: None)
    task = asyncio.ensure_future(relay.run())
    payload_up = os.urandom(300_000)
    payload_down = os.urandom(500_000)

    async def upstream() -> bytes:
        got = await _read_all(loop, up_srv)  # ends at the client's half-close
        await loop.sock_sendall(up_srv, payload_down)  # still possible after it
        up_srv.shutdown(socket.SHUT_WR)
        return got

    async def client() -> bytes:
        await loop.sock_sendall(client_app, payload_up)
        client_app.shutdown(socket.SHUT_WR)
        return await _read_all(loop, client_app)

    got_up, got_down = await asyncio.gather(upstream(), client())
    await asyncio.wait_for(task, 30)
    assert got_up == payload_up and got_down == payload_down
    assert (relay.bytes_up, relay.bytes_down) == (len(payload_up), len(payload_down))
    for s in (client_app, client_gw, up_gw, up_srv):
        s.close()
    if pool:
        pool.close()


@pytest.mark.parametrize("mode", MODES)
async def test_upload_cap_is_exact(mode: str) -> None:
    loop = asyncio.get_running_loop()
    client_app, client_gw = tcp_pair()
    up_gw, up_srv = tcp_pair()
    cap = 100_000
    used = 0

    def count(n: int) -> bool:
        nonlocal used
        used += n
        return used <= cap

    pool = PipePool() if mode == "splice" else None
    relay = Relay(client_gw, up_gw, count_up=count, pool=pool, on_activity=lambda: None)
    task = asyncio.ensure_future(relay.run())
    sender = asyncio.ensure_future(loop.sock_sendall(client_app, b"x" * 1_000_000))
    with pytest.raises(UploadLimit):
        await asyncio.wait_for(task, 30)
    sender.cancel()
    up_gw.close()  # what the gateway does on UploadLimit
    received = await _read_all(loop, up_srv)
    assert len(received) <= cap
    for s in (client_app, client_gw, up_srv):
        s.close()


F_GETPIPE_SZ = 1032


@pytest.mark.skipif(not splice_works(), reason="splice unavailable")
def test_pooled_pipes_are_large_and_fall_back_when_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fcntl

    from stockade.gateway import relay_pump as relay_mod

    pool = PipePool()
    r, w = pool.get()
    assert fcntl.fcntl(w, F_GETPIPE_SZ) == relay_mod.PIPE_BYTES == pool.size
    pool.put((r, w))
    pool.close()

    def refuse(fd: int, cmd: int, arg: int = 0) -> int:
        raise PermissionError("pipe quota")

    monkeypatch.setattr(relay_mod.fcntl, "fcntl", refuse)
    small = PipePool()
    pipe = small.get()
    assert small.size == relay_mod.CHUNK  # splices then ask for what a default pipe holds
    small.discard(pipe)


@pytest.mark.parametrize("mode", MODES)
async def test_a_download_side_reset_ends_the_relay(mode: str) -> None:
    """The upstream resets while the client is quiet: the upload side, waiting for the
    client, is failed with the download side's error (no task cancellation involved)."""
    client_app, client_gw = tcp_pair()
    up_gw, up_srv = tcp_pair()
    pool = PipePool() if mode == "splice" else None
    relay = Relay(client_gw, up_gw, count_up=lambda n: True, pool=pool, on_activity=lambda: None)
    task = asyncio.ensure_future(relay.run())
    await asyncio.sleep(0.05)
    up_srv.sendall(b"data")  # unread by the client app: the relay must move it first
    await asyncio.sleep(0.05)
    up_srv.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    up_srv.close()  # RST
    with pytest.raises(OSError):
        await asyncio.wait_for(task, 10)
    assert relay.bytes_down == 4
    for s in (client_app, client_gw, up_gw):
        s.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sent", [0, 5, 11])
async def test_first_bytes_partly_sent_before_the_relay(mode: str, sent: int) -> None:
    """The gateway sends what it can of the sniffed bytes before building the relay: the
    relay sends only the rest, and still counts all of them."""
    loop = asyncio.get_running_loop()
    client_app, client_gw = tcp_pair()
    up_gw, up_srv = tcp_pair()
    first = b"hello world"
    up_gw.sendall(first[:sent])
    pool = PipePool() if mode == "splice" else None
    relay = Relay(
        client_gw, up_gw, count_up=lambda n: True, pool=pool, on_activity=lambda: None,
        first=first, first_sent=sent,
    )
    task = asyncio.ensure_future(relay.run())
    await loop.sock_sendall(client_app, b"!")
    client_app.shutdown(socket.SHUT_WR)
    got = await asyncio.wait_for(_read_all(loop, up_srv), 10)
    up_srv.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(task, 10)
    assert got == first + b"!"
    assert relay.bytes_up == len(first) + 1
    for s in (client_app, client_gw, up_gw, up_srv):
        s.close()
    if pool:
        pool.close()


def _relay(
    client_gw: socket.socket, up_gw: socket.socket, mode: str, **kw: object
) -> tuple[Relay, PipePool | None]:
    pool = PipePool() if mode == "splice" else None
    relay = Relay(
        client_gw, up_gw, count_up=lambda n: True, pool=pool, on_activity=lambda: None, **kw
    )  # type: ignore[arg-type]
    return relay, pool


async def _no_eof_within(loop: asyncio.AbstractEventLoop, s: socket.socket, t: float) -> bytes:
    """What `s` receives within `t` seconds; fails if that includes the peer's EOF."""
    got = bytearray()
    end = loop.time() + t
    while (left := end - loop.time()) > 0:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(s, 65536), left)
        except TimeoutError:
            break
        assert chunk, "EOF reached the upstream"
        got += chunk
    return bytes(got)


@pytest.mark.parametrize("mode", MODES)
async def test_an_upload_limit_met_by_the_first_bytes_never_reads_the_client(mode: str) -> None:
    """A plain-HTTP request whose head (and body) were the first bytes: the client's
    pipelined next request is never read, no EOF is sent upstream, and the relay ends
    when the upstream's answer does."""
    loop = asyncio.get_running_loop()
    client_app, client_gw = tcp_pair()
    up_gw, up_srv = tcp_pair()
    first = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    relay, pool = _relay(client_gw, up_gw, mode, first=first, up_limit=len(first))
    task = asyncio.ensure_future(relay.run())
    await loop.sock_sendall(client_app, b"GET /second HTTP/1.1\r\nHost: a\r\n\r\n")
    assert await _no_eof_within(loop, up_srv, 0.3) == first
    await loop.sock_sendall(up_srv, b"HTTP/1.1 200 OK\r\n\r\n")
    up_srv.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(task, 10)
    assert await _read_all(loop, client_app) == b"HTTP/1.1 200 OK\r\n\r\n"
    assert (relay.bytes_up, relay.bytes_down) == (len(first), 19)
    for s in (client_app, client_gw, up_gw, up_srv):
        s.close()
    if pool:
        pool.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("client_eof", [False, True])
async def test_an_upload_limit_passes_exactly_its_bytes(mode: str, client_eof: bool) -> None:
    """A Content-Length body after the head: exactly up to the limit goes upstream, the
    rest is never read; the client's EOF before the limit is passed on."""
    loop = asyncio.get_running_loop()
    client_app, client_gw = tcp_pair()
    up_gw, up_srv = tcp_pair()
    head = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 200000\r\n\r\n"
    limit = len(head) + 200_000
    relay, pool = _relay(client_gw, up_gw, mode, first=head, up_limit=limit)
    task = asyncio.ensure_future(relay.run())
    body = os.urandom(200_000)
    if client_eof:  # the client gives up half-way: EOF upstream after 1,000 bytes
        await loop.sock_sendall(client_app, body[:1000])
        client_app.shutdown(socket.SHUT_WR)
        assert await asyncio.wait_for(_read_all(loop, up_srv), 10) == head + body[:1000]
    else:
        await loop.sock_sendall(client_app, body + b"GET /smuggled HTTP/1.1\r\n\r\n")
        got = bytearray()
        while len(got) < limit:
            got += await asyncio.wait_for(loop.sock_recv(up_srv, 65536), 10)
        assert bytes(got) == head + body
        assert await _no_eof_within(loop, up_srv, 0.3) == b""  # nothing after the limit
    await loop.sock_sendall(up_srv, b"ok")
    up_srv.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(task, 10)
    assert relay.bytes_up == (len(head) + 1000 if client_eof else limit)
    for s in (client_app, client_gw, up_gw, up_srv):
        s.close()
    if pool:
        pool.close()


@pytest.mark.parametrize("mode", MODES)
async def test_first_bytes_larger_than_the_upstreams_buffers(mode: str) -> None:
    """First bytes the upstream cannot take at once: the relay sends the rest as the
    upstream reads, then relays the client's next bytes after them, in order."""
    loop = asyncio.get_running_loop()
    client_app, client_gw = tcp_pair()
    up_gw, up_srv = tcp_pair()
    first = os.urandom(8 << 20)
    sent = up_gw.send(first)  # what fits now (the gateway's own first send)
    assert sent < len(first)
    relay, pool = _relay(client_gw, up_gw, mode, first=first, first_sent=sent)
    task = asyncio.ensure_future(relay.run())
    await loop.sock_sendall(client_app, b"after")
    client_app.shutdown(socket.SHUT_WR)
    got = await asyncio.wait_for(_read_all(loop, up_srv), 30)
    assert got == first + b"after"
    up_srv.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(task, 10)
    assert relay.bytes_up == len(first) + 5
    for s in (client_app, client_gw, up_gw, up_srv):
        s.close()
    if pool:
        pool.close()
