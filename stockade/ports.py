"""Free local ports for services started on the fly (the demo, dev OpenBao, tests, benches).

A port the kernel hands out for `bind(port 0)` lies in `ip_local_port_range`, the same
range it draws outgoing connections' source ports from: between the probe and the
service's own bind, any `connect()` on the host may take it ("address already in use").
So the ports here are drawn at random from outside that range and checked free."""

from __future__ import annotations

import collections
import secrets
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Below this are well-known ports and the ones distributions give to system services.
LOWEST = 10000
# Callers probe several ports before binding any (the demo's listeners): one process is
# never handed the same port twice among its last few hundred.
_handed: collections.deque[int] = collections.deque(maxlen=512)


def ephemeral_range(text: str | None = None) -> tuple[int, int]:
    """The kernel's source-port range (Linux's default when it cannot be read)."""
    try:
        raw = EPHEMERAL_RANGE.read_text() if text is None else text
        lo, hi = (int(x) for x in raw.split())
    except (OSError, ValueError):
        return (32768, 60999)
    return (min(lo, hi), max(lo, hi))


def outside_ranges(ephemeral: tuple[int, int], lowest: int = LOWEST) -> list[range]:
    """The ports from `lowest` up to 65535 that are not in the ephemeral range."""
    lo, hi = ephemeral
    spans = [range(lowest, max(lowest, lo)), range(max(lowest, hi + 1), 65536)]
    return [s for s in spans if len(s)]


def candidate(ranges: list[range]) -> int:
    """One port drawn uniformly over all of `ranges`."""
    total = sum(len(r) for r in ranges)
    if not total:
        raise RuntimeError("no ports outside the ephemeral range")
    pick = secrets.randbelow(total)
    for r in ranges:
        if pick < len(r):
            return r[pick]
        pick -= len(r)
    raise AssertionError("unreachable")


def _bindable(host: str, port: int, kinds: tuple[int, ...]) -> bool:
    socks: list[socket.socket] = []
    try:
        for kind in kinds:
            s = socket.socket(socket.AF_INET, kind)
            socks.append(s)
            s.bind((host, port))
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
    return True


def _free(host: str, kinds: tuple[int, ...], attempts: int = 200) -> int:
    ranges = outside_ranges(ephemeral_range())
    for _ in range(attempts):
        port = candidate(ranges)
        if port not in _handed and _bindable(host, port, kinds):
            _handed.append(port)
            return port
    raise RuntimeError("no free port outside the ephemeral range")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, outside the kernel's source-port range."""
    return _free(host, (socket.SOCK_STREAM,))


def free_dual_port(host: str = "0.0.0.0") -> int:  # noqa: S104
    """A port free for both UDP and TCP (a DNS listener binds both)."""
    return _free(host, (socket.SOCK_DGRAM, socket.SOCK_STREAM))


def free_port_block(count: int, host: str = "0.0.0.0", attempts: int = 200) -> int:  # noqa: S104
    """A base port such that base .. base+count-1 are all free for TCP and UDP right now
    (for `base_port`, which lays an instance's listeners out consecutively), all outside
    the ephemeral range."""
    kinds = (socket.SOCK_STREAM, socket.SOCK_DGRAM)
    blocks = [range(r.start, r.stop - count + 1) for r in outside_ranges(ephemeral_range())]
    blocks = [b for b in blocks if len(b)]
    for _ in range(attempts):
        base = candidate(blocks)
        ports = range(base, base + count)
        if not set(ports) & set(_handed) and all(_bindable(host, p, kinds) for p in ports):
            _handed.extend(ports)
            return base
    raise RuntimeError(f"no block of {count} free ports")
