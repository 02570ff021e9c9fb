"""The one exit of every refused connection: what the client is told, then a half-close.

The bytes depend only on the listener, whether a CONNECT tunnel is already open, and the
flow's protocol (`refusal_bytes`, pure): HTTP and explicit-proxy clients get a 403/502
with the stable code, TLS clients a fatal alert, raw TCP nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from stockade.policy.reasons import Reason

from ..deny import TLS_ALERT_ACCESS_DENIED, http_denial
from ..flow import FlowDecision, Listener
from .conn import Conn

SEND_TIMEOUT_S = 2.0  # a client that does not read its refusal does not hold us


def refusal_bytes(
    listener: Listener,
    tunnel: bool,
    protocol: str,
    reason: str,
    rule: str | None,
    task_id: str | None,
    status: int = 403,
) -> bytes:
    if protocol == "tls":
        return TLS_ALERT_ACCESS_DENIED
    if protocol == "http" or (listener == "proxy" and not tunnel):
        return http_denial(reason, rule, task_id, status=status)
    return b""


def denial(d: FlowDecision, reason: Reason, detail: str) -> FlowDecision:
    """A flow decided (allowed or not) and then refused later, for `reason`: the
    decision's destination and rule, nothing of its verdict."""
    return FlowDecision(
        False,
        reason,
        d.protocol,
        d.port,
        host=d.host,
        ip=d.ip,
        rule_id=d.rule_id,
        policy_version=d.policy_version,
        detail=detail,
    )


async def refuse(
    conn: Conn,
    reason: str,
    rule: str | None,
    protocol: str,
    status: int = 403,
) -> None:
    tid = conn.task.task_id if conn.task else None
    tunnel = bool(conn.meta.get("tunnel"))
    payload = refusal_bytes(conn.listener, tunnel, protocol, reason, rule, tid, status)
    await send_and_close(conn.client, payload)


async def send_and_close(client: socket.socket, payload: bytes) -> None:
    loop = asyncio.get_running_loop()
    if payload:
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(loop.sock_sendall(client, payload), SEND_TIMEOUT_S)
    with contextlib.suppress(OSError):
        client.shutdown(socket.SHUT_WR)

