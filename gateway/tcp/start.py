"""The start of an allowed flow's relay: what goes upstream first, what is held back
(a watched TLS tunnel's bytes after its first ClientHello), and the relay."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from stockade.policy.reasons import Reason

from ..flow import FlowDecision
from ..relay import PipePool, Relay, RetryGate
from ..sniff_http import body_length, force_close
from ..tls_retry import Refused, RetryWatch, first_hello_end
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


def retry_gate(
    inner: Sniffed, d: FlowDecision, max_bytes: int
) -> tuple[RetryGate, int] | Refused | None:
    """For an uninspected TLS flow to a named host: the gate that watches it for a
    HelloRetryRequest and where its first ClientHello's records end in `inner.data` (what
    follows is held); a refusal (bytes that cannot be held apart from the hello); None:
    not watched (plain HTTP, raw TCP, an address by cidr rule, an inspected flow)."""
    if inner.tls is None or d.protocol != "tls" or d.host is None or d.reason == Reason.INSPECTED:
        return None
    end = first_hello_end(inner.data, inner.tls.size)
    if isinstance(end, Refused):
        return end
    # the decision's host is the first SNI through normalize_host: the second must match
    return RetryGate(RetryWatch(d.host, max_bytes), inner.data[end:]), end


def make_relay(
    conn: Conn,
    upstream: socket.socket,
    first: tuple[bytes, int, int | None],
    count_up: Callable[[int], bool],
    pool: PipePool | None,
    loop: asyncio.AbstractEventLoop | None = None,
    gate: RetryGate | None = None,
) -> Relay:
    """`first`: (the first bytes, how many of them are sent already, the upload cap);
    `gate`: a watched TLS tunnel's (it holds the bytes after `first`)."""
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
        gate=gate,
    )
