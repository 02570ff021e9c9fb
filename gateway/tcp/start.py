"""The start of an allowed flow's relay: what goes upstream first, and the relay."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from ..flow import FlowDecision
from ..relay import PipePool, Relay
from ..sniff_http import body_length, force_close
from .conn import Conn, touch
from .flight import Sniffed


def first_bytes(inner: Sniffed, d: FlowDecision) -> tuple[bytes, int | None]:
    """(the sniffed bytes to send upstream, the cap on all bytes sent up or None).

    One decided request per plain-HTTP connection (see sniff_http.force_close): its head
    and Content-Length body go upstream, nothing the client sends after (a pipelined
    second request) is ever read from it."""
    if inner.http is None or d.protocol != "http":
        return inner.data, None
    closed = force_close(inner.http, inner.data)
    head_len = inner.http.head_len + len(closed) - len(inner.data)
    up_limit = head_len + (body_length(inner.http) or 0)
    return closed[:up_limit], up_limit


def make_relay(
    conn: Conn,
    upstream: socket.socket,
    first: tuple[bytes, int, int | None],
    count_up: Callable[[int], bool],
    pool: PipePool | None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Relay:
    """`first`: (the first bytes, how many of them are sent already, the upload cap)."""
    data, sent, up_limit = first
    return Relay(
        conn.client,
        upstream,
        count_up=count_up,
        pool=pool,
        on_activity=lambda: touch(conn),
        first=data,
        first_sent=sent,
        up_limit=up_limit,
        loop=loop,
    )
