"""The least a Python CONNECT proxy can do per connection: a reference row for the bench.

Not a product: no policy, no sniffing, no events, no half-close, one fixed upstream.
It reads a CONNECT head, answers 200, dials 127.0.0.1:<upstream> while the client sends
its first bytes, and then moves bytes both ways with uvloop reader/writer callbacks and
recv/send. It has exactly the hops of a CONNECT proxy (the gateway's extra hops over a
direct connection), so `gateway +p50 - floor +p50` is the cost of the gateway's own work
per connection on this host, and `floor +p50` what the hops alone cost.

usage: floor_proxy.py LISTEN_PORT UPSTREAM_PORT
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable

CHUNK = 65536
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


class Pipe:
    """One direction: src -> dst, with back-pressure (stop reading while dst is full)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        src: socket.socket,
        dst: socket.socket,
        on_end: Callable[[], None],
    ) -> None:
        self.loop, self.src, self.dst, self.on_end = loop, src, dst, on_end
        self.pending = b""

    def start(self) -> None:
        self.loop.add_reader(self.src.fileno(), self.readable)

    def readable(self) -> None:
        try:
            data = self.src.recv(CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.on_end()
            return
        self.push(data)

    def push(self, data: bytes) -> None:
        try:
            sent = self.dst.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.on_end()
            return
        if sent < len(data):
            self.pending = data[sent:]
            self.loop.remove_reader(self.src.fileno())
            self.loop.add_writer(self.dst.fileno(), self.writable)

    def writable(self) -> None:
        data, self.pending = self.pending, b""
        self.loop.remove_writer(self.dst.fileno())
        self.push(data)
        if not self.pending:
            self.start()


def serve(listen_port: int, upstream_port: int) -> None:
    loop = asyncio.new_event_loop()
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", listen_port))
    lsock.listen(4096)
    lsock.setblocking(False)

    def connection(client: socket.socket) -> None:
        state: dict[str, socket.socket] = {}

        def end() -> None:
            for s in (client, state.get("up")):
                if s is not None and s.fileno() >= 0:
                    loop.remove_reader(s.fileno())
                    loop.remove_writer(s.fileno())
                    s.close()

        def first_bytes() -> None:
            try:
                data = client.recv(CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                end()
                return
            if "up" not in state:  # the CONNECT head (one segment from the bench's client)
                client.send(ESTABLISHED)
                up = socket.socket()
                up.setblocking(False)
                up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                up.connect_ex(("127.0.0.1", upstream_port))
                state["up"] = up
                return
            loop.remove_reader(client.fileno())
            up_pipe = Pipe(loop, client, state["up"], end)
            up_pipe.push(data)  # the handshake to a loopback upstream is done by now
            Pipe(loop, state["up"], client, end).start()
            if not up_pipe.pending:
                up_pipe.start()

        loop.add_reader(client.fileno(), first_bytes)

    def accept() -> None:
        while True:
            try:
                client, _ = lsock.accept()
            except BlockingIOError:
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection(client)

    loop.add_reader(lsock.fileno(), accept)
    print("ready", flush=True)
    loop.run_forever()


if __name__ == "__main__":
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    serve(int(sys.argv[1]), int(sys.argv[2]))
