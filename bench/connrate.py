"""New connections per second with keep-alive off: gateway_bench's `--rate` row.

Client processes (uvloop where installed) each run `--concurrency` loops of: connect,
`CONNECT localhost:<upstream>` (direct: none), read the `200`, send the ClientHello,
read the upstream's ServerHello head, send `P`, read the upstream's one byte, close; as
fast as they go, for a fixed window that all clients and the CPU reading share
(CLOCK_MONOTONIC is the same in every process). Only connections completed inside the
window count. The proxy's CPU over the window, as a share of one core, says whether that
one process was the bottleneck (about 100%: it was saturated; less: the clients or the
upstream, which share the two cores, were). On a 2-core host Python clients cannot
saturate a proxy, so the table also gives connections per second of the proxy's own CPU
time: the rate one process would reach on a core of its own.

Run as a script it is one client: `connrate.py PROXY_PORT|- UPSTREAM_PORT START END CONC`
(the ClientHello on stdin), printing the number of connections it completed.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

CLIENTS = 2  # client processes: one per core of the 2-core host
CONCURRENCY = 16  # connection loops per client process
WARMUP_S = 1.0  # from spawning the clients to the window's start
# the bench upstream answers a ClientHello with a ServerHello record head (5 + 38 bytes)
# before it reads the command, and clients send the command after it, as TLS does (a
# gateway holds a TLS client's bytes after its first hello until the server's first
# handshake message went by: docs/gateway.md, HelloRetryRequest)
SERVER_HELLO_LEN = 43


async def _one(proxy: int | None, upstream: int, hello: bytes) -> None:
    port = upstream if proxy is None else proxy
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if proxy is not None:
            auth = f"localhost:{upstream}"
            writer.write(f"CONNECT {auth} HTTP/1.1\r\nHost: {auth}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                raise RuntimeError(f"CONNECT refused: {head[:80]!r}")
        writer.write(hello)
        await reader.readexactly(SERVER_HELLO_LEN)  # answered like a TLS server first
        writer.write(b"P")
        if await reader.readexactly(1) != b"!":
            raise RuntimeError("no first byte")
    finally:
        writer.close()


async def _client(
    proxy: int | None, upstream: int, hello: bytes, start: float, end: float, conc: int
) -> int:
    done = 0

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < end:
            await _one(proxy, upstream, hello)
            if start <= time.monotonic() < end:
                done += 1

    await asyncio.gather(*(loop() for _ in range(conc)))
    return done


def _main(argv: list[str]) -> int:
    proxy = None if argv[0] == "-" else int(argv[0])
    upstream, start, end, conc = int(argv[1]), float(argv[2]), float(argv[3]), int(argv[4])
    hello = sys.stdin.buffer.read()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(asyncio.run(_client(proxy, upstream, hello, start, end, conc)))
    return 0


@dataclass
class Rate:
    per_s: float  # connections completed per second in the window
    cpu_share: float | None  # the proxy's CPU over the window / its length (1.0 = a core)


def measure(
    proxy_port: int | None,
    upstream_port: int,
    hello: bytes,
    seconds: float,
    cpu: Callable[[], float] | None,
) -> Rate:
    """One window of `seconds`: CLIENTS processes against `proxy_port` (None: direct)."""
    start = time.monotonic() + WARMUP_S
    end = start + seconds
    argv = [
        sys.executable,
        __file__,
        "-" if proxy_port is None else str(proxy_port),
        str(upstream_port),
        repr(start),
        repr(end),
        str(CONCURRENCY),
    ]
    procs = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in range(CLIENTS)
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(hello)
        p.stdin.close()
    time.sleep(max(0.0, start - time.monotonic()))
    c0 = cpu() if cpu else 0.0
    time.sleep(max(0.0, end - time.monotonic()))
    c1 = cpu() if cpu else 0.0
    total = 0
    for p in procs:
        assert p.stdout is not None
        out = p.stdout.read()
        if p.wait(timeout=60) != 0:
            raise RuntimeError(f"connection-rate client failed ({p.returncode})")
        total += int(out)
    return Rate(total / seconds, (c1 - c0) / seconds if cpu else None)


def per_cpu_second(windows: list[Rate]) -> float | None:
    """Connections per second of the proxy's CPU time, over all windows."""
    cpu = sum(r.cpu_share for r in windows if r.cpu_share is not None)
    return sum(r.per_s for r in windows) / cpu if cpu else None


def print_rates(rates: list[tuple[str, str, list[Rate]]], seconds: float) -> None:
    """The `--rate` table: (key, name, windows) per path; vs Squid where it ran."""

    squid = next(
        (statistics.median([r.per_s for r in w]) for k, _, w in rates if k == "squid"), None
    )
    squid_core = next((per_cpu_second(w) for k, _, w in rates if k == "squid"), None)
    print(
        f"\nnew connections/s, keep-alive off ({CLIENTS} client processes x {CONCURRENCY} "
        f"loops, {seconds:.0f} s windows, median of windows; proxy CPU in % of one core)"
    )
    hdr = (
        f"{'path':32} {'conn/s':>8} {'min-max':>13} {'proxy CPU':>10} {'vs squid':>9}"
        f" {'conn/CPU-s':>11} {'vs squid':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for _key, name, windows in rates:
        per_s = [r.per_s for r in windows]
        per_core = per_cpu_second(windows)
        cpu = (
            f"{statistics.median([r.cpu_share for r in windows if r.cpu_share]):.0%}"
            if per_core
            else "-"
        )
        vs = f"{statistics.median(per_s) / squid:.2f}x" if squid else "-"
        span = f"{min(per_s):.0f}-{max(per_s):.0f}"
        core = f"{per_core:.0f}" if per_core else "-"
        vs_core = f"{per_core / squid_core:.2f}x" if per_core and squid_core else "-"
        rate = statistics.median(per_s)
        print(f"{name:32} {rate:8.0f} {span:>13} {cpu:>10} {vs:>9} {core:>11} {vs_core:>9}")
    print(
        "conn/CPU-s: connections per second of the proxy's own CPU time over the windows, "
        "the rate one process would reach at 100% of a core"
    )


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
