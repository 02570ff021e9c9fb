"""Resolve or check, then connect to a checked address (never the client's choice), or
hand the checked address to the L7 inspector."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from stockade.net.addresses import AddressPolicy
from stockade.net.resolver import Resolver
from stockade.tasks import Task

from ..flow import FlowDecision
from ..inspector.handoff import FlowMeta
from ..relay import wait_fd
from ..settings import GatewaySettings
from .conn import Conn
from .names import UNRESOLVABLE_DETAIL, NameGate


class Failure(NamedTuple):
    """Why no upstream socket: the denial's reason, detail and HTTP status."""

    reason: Reason
    detail: str
    status: int


# (socket, dialled address, None) or (None, "", why not)
DialResult = tuple[socket.socket | None, str, Failure | None]
UNREACHABLE = Failure(
    Reason.UPSTREAM_UNREACHABLE, "no checked address accepted the connection", 502
)
_IN_PROGRESS = (errno.EINPROGRESS, errno.EINTR, errno.EAGAIN)


@dataclass
class EarlyDial:
    """A CONNECT's dial begun before its inner bytes were decided: a task (the name had
    to be resolved first), or a socket whose handshake is under way."""

    task: asyncio.Future[DialResult] | None
    started: tuple[socket.socket, int] | None = None  # (socket, connect_ex result)
    addresses: list[str] = field(default_factory=list)
    port: int = 0


class Dialer:
    def __init__(
        self,
        settings: GatewaySettings,
        address_policy: AddressPolicy,
        resolver: Resolver,
        names: NameGate,
    ) -> None:
        self.settings = settings
        self.address_policy = address_policy
        self.resolver = resolver
        self.names = names
        # the running loop, bound by the gateway's start (asking asyncio for it is a
        # getpid(2) on 3.11); None: looked up per dial
        self.loop: asyncio.AbstractEventLoop | None = None

    async def checked_dial(self, d: FlowDecision, task: Task, ruleset: RuleSet) -> DialResult:
        """Resolve (names) or check (cidr literals) and connect to a checked address."""
        addresses, failure = await self.checked_addresses(d, task, ruleset)
        if failure is not None:
            return None, "", failure
        return await self.dial(addresses, d.port)

    async def checked_addresses(
        self, d: FlowDecision, task: Task, ruleset: RuleSet
    ) -> tuple[list[str], Failure | None]:
        """The addresses a flow may be dialled at, or why there are none."""
        if d.ip is not None:
            category = self.address_policy.check(d.ip)
            if category is not None:
                return [], Failure(Reason.ADDRESS_FORBIDDEN, f"address category {category}", 403)
            return [d.ip], None
        assert d.host is not None
        host = d.host
        reserved = self.names.reserve(task, ruleset, host)
        if reserved is False:
            return [], Failure(Reason.UNRESOLVABLE_NAME_BUDGET, UNRESOLVABLE_DETAIL, 403)
        try:
            res = await self.resolver.resolve(host)
        finally:
            if reserved is not None:
                self.names.release(reserved)
        if res.error is not None or (not res.addresses and not res.forbidden):
            self.names.record_unresolvable(task, ruleset, host)
        if not res.addresses:
            if res.forbidden:
                cats = ", ".join(sorted({c for _, c in res.forbidden}))
                detail = f"name resolves only to forbidden addresses ({cats})"
                return [], Failure(Reason.ADDRESS_FORBIDDEN, detail, 403)
            detail = f"resolution failed: {res.error or 'no address'}"
            return [], Failure(Reason.RESOLVE_FAILED, detail, 403)
        return list(res.addresses), None

    def begin(self, d: FlowDecision, task: Task, ruleset: RuleSet) -> EarlyDial:
        """Start `checked_dial` for a CONNECT authority while the client sends its first
        bytes. When the name is in the resolver cache (the usual case) the upstream
        handshake starts right here and is finished inline by `early_result` (no task:
        a task's first step would only run at the caller's next await, and waiting on it
        costs event-loop rounds); otherwise a task resolves and dials."""
        res = self.resolver.cached(d.host) if d.ip is None and d.host is not None else None
        if res is not None and res.addresses:
            self.resolver.hits += 1  # what resolve() counts for a cached answer
            ip = res.addresses[0]  # checked addresses only (the resolver filters them)
            sock = stream_socket(ip)
            try:
                err = sock.connect_ex((ip, d.port))
            except OSError:
                sock.close()
            else:
                return EarlyDial(None, (sock, err), list(res.addresses), d.port)
        return EarlyDial(asyncio.ensure_future(self.checked_dial(d, task, ruleset)))

    async def early_result(self, early: EarlyDial) -> DialResult:
        if early.task is not None:
            return await early.task
        assert early.started is not None
        started, early.started = early.started, None  # from here `dial` owns the socket
        return await self.dial(early.addresses, early.port, started)

    async def dial(
        self,
        addresses: list[str],
        port: int,
        started: tuple[socket.socket, int] | None = None,
    ) -> DialResult:
        """Connect to the first address that accepts. `started`: the socket and
        connect_ex result of a connect to `addresses[0]` already under way."""
        loop = self.loop or asyncio.get_running_loop()
        for i, ip in enumerate(addresses):
            err: int | None = None
            if i == 0 and started is not None:
                sock, err = started
            else:
                sock = stream_socket(ip)
            deadline = loop.time() + self.settings.connect_timeout_s
            try:
                await connect(loop, sock, (ip, port), err, deadline)
            except (OSError, TimeoutError):
                sock.close()
                continue
            except BaseException:
                sock.close()
                raise
            return sock, ip, None
        return None, "", UNREACHABLE


async def hand_over(
    conn: Conn, task: Task, ruleset: RuleSet, d: FlowDecision, dialer: Dialer, inspector: Any
) -> DialResult:
    """Resolve and check like any flow, then hand the checked address to the inspector
    (never the name, never the client's destination). The result's socket is the
    inspector's end of the tunnel; the relay runs between it and the client."""
    addresses, failure = await dialer.checked_addresses(d, task, ruleset)
    if failure is not None:
        return None, "", failure
    assert d.host is not None
    ip = addresses[0]
    if len(addresses) > 1:
        # the inspector dials one address, lazily: pick the first that accepts a
        # connection (as `Dialer.dial` does for every other flow) before handing it over
        probe, ip, failure = await dialer.dial(addresses, d.port)
        if probe is None:
            return None, "", failure
        probe.close()
    meta = FlowMeta(
        connection_id=conn.id,
        task_id=task.task_id,
        profile=task.profile,
        host=d.host,
        ip=ip,
        port=d.port,
        policy_version=d.policy_version,
        source_ip=conn.peer[0],
        source_port=conn.peer[1],
        listener=conn.listener,
    )
    try:
        sock = await inspector.handoff(meta)
    except Exception as e:  # InspectorUnavailable, or a meta that cannot be encoded
        return None, "", Failure(Reason.INSPECTION_UNAVAILABLE, str(e) or type(e).__name__, 403)
    return sock, ip, None


async def discard(early: EarlyDial) -> None:
    """Abandon an early dial and close its socket if it already connected."""
    if early.started is not None:
        early.started[0].close()
        early.started = None
    if early.task is None:
        return
    early.task.cancel()
    with contextlib.suppress(BaseException):
        sock, _, _ = await early.task
        if sock is not None:
            sock.close()


def send_some(sock: socket.socket, data: bytes) -> int:
    """What one non-blocking send takes of `data` (0 on any error: the relay sends the
    rest, and meets the error itself)."""
    if not data:
        return 0
    try:
        return sock.send(data)
    except OSError:
        return 0


def stream_socket(ip: str) -> socket.socket:
    # non-blocking from socket(2) itself: no ioctl per dial (Python sees the flag and
    # keeps the socket's timeout at 0, as setblocking(False) would)
    kind = socket.SOCK_STREAM | getattr(socket, "SOCK_NONBLOCK", 0)
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, kind)
    if sock.gettimeout() != 0.0:  # no SOCK_NONBLOCK on this platform
        sock.setblocking(False)
    try:  # noqa: SIM105 - no context object: this runs per connection
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    return sock


async def connect(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    addr: tuple[str, int],
    err: int | None = None,
    deadline: float | None = None,
) -> None:
    """Non-blocking connect to a numeric address.

    Not `loop.sock_connect`: uvloop's passes every address through getaddrinfo on its
    thread pool, a thread hop of a few hundred microseconds on the set-up latency of every
    connection, for an address that is already numeric and checked.
    """
    if err is None:  # else: connect_ex already ran (see Dialer.begin)
        err = sock.connect_ex(addr)
    if err in _IN_PROGRESS:
        # ask again before waiting: a handshake to a nearby host is often already done
        # (EISCONN), and a writability wait costs several event-loop rounds
        err = sock.connect_ex(addr)
        if err == errno.EISCONN:
            return
        if err in _IN_PROGRESS or err == errno.EALREADY:
            await wait_fd(loop, sock.fileno(), True, deadline)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))
