"""Listening sockets: their options, and accepting from a reader callback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Callable
from typing import Any

from stockade.listen import parse_listen
from stockade.tcp import set_congestion_control

from ..flow import Listener
from ..settings import GatewaySettings

log = logging.getLogger("stockade.gateway")
ACCEPT_BATCH = 64  # connections accepted per readiness callback before yielding
BACKLOG = 4096  # the listen queue (the kernel caps it at net.core.somaxconn)
OnAccept = Callable[[Listener, socket.socket, tuple[Any, ...]], None]


def open_listener(kind: Listener, addr: str, settings: GatewaySettings) -> socket.socket:
    """A bound, listening, non-blocking socket for `addr` with the options of `kind`."""
    host, port = parse_listen(addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, port))
    if kind == "proxy" and hasattr(socket, "TCP_DEFER_ACCEPT"):
        # explicit-proxy clients always speak first: the kernel hands a connection
        # over only once its request bytes are there, which saves a wake-up and an
        # event-loop round per connection (and holds silent clients in the kernel,
        # not in a descriptor of ours, for up to this many seconds)
        with contextlib.suppress(OSError):
            sock.setsockopt(
                socket.IPPROTO_TCP,
                socket.TCP_DEFER_ACCEPT,
                max(1, math.ceil(settings.sniff_timeout_s)),
            )
    set_congestion_control(
        sock,
        settings.sandbox_congestion_control,
        "gateway.sandbox_congestion_control",
        log,
    )
    # accepted sockets inherit it (Linux): one setsockopt per listener, not per connection
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def accept_burst(listening: Listening, on_accept: OnAccept, limit: int = ACCEPT_BATCH) -> None:
    """Accept up to `limit` pending connections, handing each to `on_accept`."""
    for _ in range(limit):
        try:
            client, peer = listening.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except ConnectionAbortedError:
            continue  # reset before it was accepted: no socket left to decide
        except OSError:
            listening.pause(0.05)  # EMFILE and friends: back off, keep serving
            return
        on_accept(listening.kind, client, peer)


class Listening:
    """A listening socket and its reader callback (what `stop()` closes)."""

    def __init__(
        self, kind: Listener, sock: socket.socket, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.kind = kind
        self.sock = sock
        self.loop = loop
        self.on_ready: Callable[[], None] | None = None
        self.closed = False
        self._resume: asyncio.TimerHandle | None = None

    def start(self, on_ready: Callable[[], None]) -> None:
        self.on_ready = on_ready
        self.loop.add_reader(self.sock.fileno(), on_ready)

    def pause(self, seconds: float) -> None:
        """Stop accepting for a while (out of descriptors): a level-triggered reader
        would otherwise spin on the pending connection."""
        self.loop.remove_reader(self.sock.fileno())
        if self._resume is not None:
            self._resume.cancel()
        self._resume = self.loop.call_later(seconds, self.resume)

    def resume(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if not self.closed and self.on_ready is not None:
            self.loop.add_reader(self.sock.fileno(), self.on_ready)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._resume is not None:
            self._resume.cancel()
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
