"""Server process of the fake internet: `python -m stockade.testing.testnet.serve --spec FILE`.

Runs inside the fake internet's network namespace (started by `FakeInternet` through
`ip netns exec`). Starts every listener from the spec, prints `ready` on stdout once all
are bound, and serves until SIGTERM/SIGINT. Thin asyncio shells only: DNS answers come
from `zone.Zone`, sites from `web.make_app`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import ssl
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, cast

from aiohttp import web

from stockade.testing.testnet.spec import ServeSpec
from stockade.testing.testnet.web import make_app
from stockade.testing.testnet.wheel import demo_wheels
from stockade.testing.testnet.zone import Zone

_DNS_TCP_MAX = 65535
_PR_SET_PDEATHSIG = 1


class _DnsUdp(asyncio.DatagramProtocol):
    def __init__(self, zone: Zone) -> None:
        self.zone = zone
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # not an isinstance check: 3.11's selector transport is not a DatagramTransport subclass
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply, delay = self.zone.respond(data)
        if reply is None or self.transport is None:
            return
        if delay > 0:
            # the delay is the point of slow.test; other queries keep being answered
            asyncio.get_running_loop().call_later(delay, self._send, reply, addr)
        else:
            self._send(reply, addr)

    def _send(self, reply: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(reply, addr)


async def _dns_tcp(zone: Zone, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readexactly(2)
            (length,) = struct.unpack("!H", head)
            query = await reader.readexactly(length)
            reply, delay = zone.respond(query)
            if reply is None:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            if len(reply) > _DNS_TCP_MAX:
                break
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


class _UdpEcho(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # not an isinstance check: 3.11's selector transport is not a DatagramTransport subclass
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(data, addr)


async def _tcp_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def serve(spec: ServeSpec, ready: asyncio.Event | None = None) -> None:
    """Start all listeners, print `ready`, serve until cancelled or signalled."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    query_log = open(spec.query_log, "a", buffering=1) if spec.query_log else None  # noqa: SIM115
    zone = Zone(spec.zone, _log_to(query_log) if query_log else None)
    wheels = demo_wheels(spec.projects)
    runners: list[web.AppRunner] = []
    closers: list[asyncio.BaseTransport | asyncio.Server] = []
    try:
        for site in spec.sites:
            runner = web.AppRunner(
                make_app(site.name, api_key=spec.api_key, wheels=wheels, git_root=spec.git_root),
                access_log=None,
                shutdown_timeout=1.0,  # a test teardown must not wait on idle keep-alives
            )
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, site.address, site.http_port, reuse_address=True).start()
            await web.TCPSite(
                runner,
                site.address,
                site.https_port,
                ssl_context=_tls_context(site.cert_pem, site.key_pem),
                reuse_address=True,
            ).start()

        udp, _ = await loop.create_datagram_endpoint(
            lambda: _DnsUdp(zone), local_addr=(spec.dns_address, spec.dns_port)
        )
        closers.append(udp)
        closers.append(
            await asyncio.start_server(
                lambda r, w: _dns_tcp(zone, r, w), spec.dns_address, spec.dns_port
            )
        )
        closers.append(await asyncio.start_server(_tcp_echo, *spec.tcp_echo))
        uecho, _ = await loop.create_datagram_endpoint(_UdpEcho, local_addr=spec.udp_echo)
        closers.append(uecho)

        print("ready", flush=True)
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        for c in closers:
            c.close()
        for r in runners:
            await r.cleanup()
        if query_log is not None:
            query_log.close()


def _log_to(f: TextIO) -> Callable[[str, str], None]:
    # one line per query, flushed at once: a test counts what reached the upstream
    def log(name: str, qtype: str) -> None:
        f.write(f"{qtype} {name}\n")

    return log


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGTERM us when the parent dies (even by SIGKILL), so an orphan
    server never keeps a fake internet's namespace alive. Set here rather than in a
    preexec_fn, which is unsafe in the threaded processes that start us."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stockade.testing.testnet.serve")
    parser.add_argument(
        "--spec", required=True, type=Path, help="JSON spec written by FakeInternet"
    )
    parser.add_argument("--parent-pid", type=int, help="exit when this process dies")
    args = parser.parse_args(argv)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    try:
        spec = ServeSpec.read(args.spec)
        asyncio.run(serve(spec))
    except OSError as e:
        print(f"stockade.testing.testnet.serve: cannot start: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
