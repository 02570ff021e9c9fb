"""A minimal transparent relay for ClientNamespace tests (test helper, not a gateway).

Listens on host ports the client namespace's nft table redirects to, recovers the
original destination with SO_ORIGINAL_DST and relays to it only when it lies inside the
fake internet's subnet (network safety: nothing else is ever dialled). DNS is forwarded
to the fake DNS server.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

SO_ORIGINAL_DST = 80


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    (port,) = struct.unpack("!H", raw[2:4])
    return socket.inet_ntoa(raw[4:8]), port


@dataclass
class Relay:
    subnet: str
    dns_server: str
    tcp_port: int = 0
    dns_port: int = 0
    seen: list[tuple[str, tuple[str, int]]] = field(default_factory=list)  # (kind, orig dst)


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(Exception):
            w.close()


async def _serve(relay: Relay, ready: threading.Event, stop: asyncio.Event) -> None:
    allowed = ipaddress.ip_network(relay.subnet)
    pending: set[asyncio.Future[None]] = set()

    async def on_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dst = original_dst(writer.get_extra_info("socket"))
        relay.seen.append(("tcp", dst))
        if ipaddress.ip_address(dst[0]) not in allowed:
            writer.close()
            return
        up_r, up_w = await asyncio.open_connection(*dst)
        await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))

    class DnsForward(asyncio.DatagramProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            relay.seen.append(("dns", addr))
            task = asyncio.ensure_future(self.forward(data, addr))
            pending.add(task)
            task.add_done_callback(pending.discard)

        async def forward(self, data: bytes, addr: tuple[str, int]) -> None:
            loop = asyncio.get_running_loop()
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.setblocking(False)
                await loop.sock_connect(s, (relay.dns_server, 53))
                await loop.sock_sendall(s, data)
                reply = await asyncio.wait_for(loop.sock_recv(s, 65535), 10)
            self.transport.sendto(reply, addr)  # type: ignore[attr-defined]

    loop = asyncio.get_running_loop()
    tcp = await asyncio.start_server(on_tcp, "0.0.0.0", relay.tcp_port)
    relay.tcp_port = tcp.sockets[0].getsockname()[1]

    async def on_dns_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        relay.seen.append(("dns-tcp", writer.get_extra_info("peername")))
        up_r, up_w = await asyncio.open_connection(relay.dns_server, 53)
        await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))

    # DNS needs one port number free on both UDP and TCP: a port the kernel picked for UDP
    # may be taken on TCP by another process, so retry with a fresh one
    for attempt in range(20):
        udp, _ = await loop.create_datagram_endpoint(
            DnsForward, local_addr=("0.0.0.0", relay.dns_port)
        )
        port = udp.get_extra_info("sockname")[1]
        try:
            dns_tcp = await asyncio.start_server(on_dns_tcp, "0.0.0.0", port)
        except OSError:
            udp.close()
            if relay.dns_port or attempt == 19:
                raise
            continue
        relay.dns_port = port
        break
    ready.set()
    await stop.wait()
    for server in (tcp, dns_tcp):
        server.close()
    udp.close()


@contextlib.contextmanager
def running_relay(subnet: str, dns_server: str) -> Iterator[Relay]:
    relay = Relay(subnet, dns_server)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    t = threading.Thread(
        target=loop.run_until_complete, args=(_serve(relay, ready, stop),), daemon=True
    )
    t.start()
    if not ready.wait(10):
        raise RuntimeError("relay did not start")
    try:
        yield relay
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(10)
