"""Free local ports for services started on the fly (the demo, dev OpenBao, tests, benches)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_dual_port(host: str = "0.0.0.0", attempts: int = 50) -> int:  # noqa: S104
    """A port free for both UDP and TCP (a DNS listener binds both): the kernel picks one
    for UDP, and it is kept only if TCP can have the same number too."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind((host, 0))
            port = int(u.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                try:
                    t.bind((host, port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port free for both UDP and TCP")


def free_port_block(count: int, host: str = "0.0.0.0", attempts: int = 200) -> int:  # noqa: S104
    """A base port such that base .. base+count-1 are all free for TCP and UDP right now
    (for `base_port`, which lays an instance's listeners out consecutively)."""
    import secrets

    for _ in range(attempts):
        base = 20000 + secrets.randbelow(30000)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                    s = socket.socket(socket.AF_INET, kind)
                    socks.append(s)
                    s.bind((host, port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no block of {count} free ports")
