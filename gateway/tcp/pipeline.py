"""One connection through the stages: locate (original destination, task) -> proxy head
-> admit (task, connection limit) -> CONNECT phase -> first flight -> decide -> route ->
dial | inspect | early dial -> start. Every refusal leaves through `_deny`."""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from dataclasses import replace
from typing import Any, NamedTuple

from stockade.policy.holder import RulesHolder
from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from stockade.tasks import Task, TaskRegistry

from ..conn_events import ConnEvents
from ..deny import CONNECT_ESTABLISHED
from ..dns.guards import GuardDenial
from ..flow import FlowDecision, FlowInput, Protocol, decide_flow
from ..original_dst import original_destination
from ..relay import PipePool, Relay, RetryGate, UploadLimit
from ..settings import GatewaySettings
from ..sniff_common import SniffError
from ..sniff_http import RequestHead
from ..tls_retry import Refused
from .conn import Conn, ConnTable, unmap_ip
from .dial import Dialer, DialResult, EarlyDial, discard, hand_over, send_some
from .flight import FirstFlight, Sniffed, read_first_flight
from .names import NameGate
from .refuse import denial, refuse
from .route import (
    ConnectVerdicts,
    InspectorState,
    Route,
    choose_route,
    connect_route,
    refuse_framing,
)
from .start import first_bytes, make_relay, retry_gate


class Started(NamedTuple):
    """An allowed flow with its upstream socket and the relay to run."""

    upstream: socket.socket
    relay: Relay
    decision: FlowDecision
    dialled: str


class ProxyHead(NamedTuple):
    connect: RequestHead | None  # a CONNECT head; else `inner` is an absolute-URI request
    pending: bytes  # bytes read after the CONNECT head
    inner: Sniffed | None


class Tunnel(NamedTuple):
    pre: FlowDecision  # the authority's verdict
    early: EarlyDial | None
    inner: Sniffed


class Pipeline:
    def __init__(
        self,
        settings: GatewaySettings,
        rules: RulesHolder,
        registry: TaskRegistry,
        table: ConnTable,
        names: NameGate,
        dialer: Dialer,
        events: ConnEvents,
        pool: PipePool | None,
    ) -> None:
        self.settings = settings
        self.rules = rules
        self.registry = registry
        self.table = table
        self.names = names
        self.dialer = dialer
        self.events = events
        self.pool = pool
        self.verdicts = ConnectVerdicts()
        # the L7 inspector (InspectorSupervisor), set by the service when inspection is on
        self.inspector: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None  # see bind()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop every connection runs on, kept by the stages that need it: asking
        asyncio for the running loop is a getpid(2) each time on 3.11 (about six per
        connection otherwise)."""
        self.loop = self.dialer.loop = self.events.batch.loop = loop

    async def run(self, conn: Conn) -> Started | None:
        """The allowed flow ready to relay, or None: refused (and logged)."""
        loop = self.loop or asyncio.get_running_loop()
        deadline = loop.time() + self.settings.sniff_timeout_s
        self._locate(conn)
        proxy = ProxyHead(None, b"", None)
        if conn.listener == "proxy":
            head = await self._proxy_head(conn, deadline)
            if head is None:
                return None
            proxy = head
        task = await self._admit(conn, deadline, proxy.connect)
        if task is None:
            return None
        ruleset = self.rules.current
        pre: FlowDecision | None = None
        early: EarlyDial | None = None
        inner = proxy.inner
        if proxy.connect is not None:
            tunnel = await self._connect_phase(conn, task, ruleset, proxy, deadline)
            if tunnel is None:
                return None
            pre, early, inner = tunnel
        elif conn.listener == "transparent":
            inner = await self._flight(conn, deadline)
        assert inner is not None
        decision = refuse_framing(self._decide(conn, task, ruleset, inner, proxy, pre), inner)
        route = choose_route(decision, pre, early is not None, InspectorState.of(self.inspector))
        followed = await self._follow(conn, task, ruleset, route, early)
        if followed is None:
            return None
        decision, (upstream, dialled, failure) = followed
        if upstream is None:
            assert failure is not None
            await self._deny(conn, denial(decision, failure.reason, failure.detail), failure.status)
            return None
        gate = retry_gate(inner, decision, self.settings.sniff_max_bytes)
        if isinstance(gate, Refused):  # bytes after the first hello it cannot hold apart
            upstream.close()
            await self._deny(conn, denial(decision, gate.reason, gate.detail))
            return None
        return self._start(conn, task, decision, upstream, dialled, inner, gate)

    def _locate(self, conn: Conn) -> None:
        # the task first: a socket reset before its address is read still has one
        conn.task = self.registry.by_address(conn.peer[0])
        locate_destination(conn)

    async def _proxy_head(self, conn: Conn, deadline: float) -> ProxyHead | None:
        sniffed = await self._flight(conn, deadline, http_only=True)
        if sniffed.error is not None or sniffed.http is None:
            err = sniffed.error or SniffError(Reason.PROTOCOL_UNRECOGNISED, "no request")
            await self._deny_early(conn, err.reason, err.detail)
            return None
        head = sniffed.http
        if head.method == "CONNECT":
            return ProxyHead(head, sniffed.data[head.head_len :], None)
        if head.form == "absolute":
            return ProxyHead(None, b"", sniffed)
        detail = "proxy request without an absolute URI"
        await self._deny_early(conn, Reason.PROTOCOL_UNRECOGNISED, detail)
        return None

    async def _admit(
        self, conn: Conn, deadline: float, connect: RequestHead | None
    ) -> Task | None:
        task = conn.task
        if task is None:
            reason, detail = Reason.UNKNOWN_TASK, "unknown source address"
        elif task.pooled:
            reason, detail = Reason.UNCLAIMED, "a warm-pool sandbox no task has claimed"
        elif not self.table.admit(conn, task, self.settings.max_connections_per_task):
            reason, detail = Reason.CONNECTION_LIMIT, "too many concurrent connections"
        else:
            return task
        # denied before any policy work, in the client's own protocol where it can be told
        protocol: Protocol = "http"
        if connect is None and conn.listener == "transparent":
            protocol = (await self._flight(conn, deadline)).kind or "tcp"
        orig = conn.meta.get("orig")
        d = FlowDecision(
            False,
            reason,
            protocol,
            orig[1] if orig else 0,
            policy_version=self.rules.current.version,
            detail=detail,
        )
        await self._deny(conn, d)
        return None

    async def _connect_phase(
        self, conn: Conn, task: Task, ruleset: RuleSet, proxy: ProxyHead, deadline: float
    ) -> Tunnel | None:
        assert proxy.connect is not None
        # decide on the authority alone first, so a denied CONNECT gets a 403
        pre = self.verdicts.get(proxy.connect, ruleset, task.profile)
        refused, l7 = connect_route(pre, InspectorState.of(self.inspector))
        if refused is not None:
            await self._deny(conn, refused)
            return None
        guarded = self.names.guard(task, pre, ruleset)
        if guarded is not None:  # refused before the 200: the client gets a 403
            await self._deny_guarded(conn, pre, guarded)
            return None
        # the 200 first (the client's round trip is the latency path), then dial the
        # checked address of the allowed authority while the client sends its first
        # bytes; nothing is sent upstream unless the full decision agrees
        sent = send_some(conn.client, CONNECT_ESTABLISHED)  # a new socket takes it all
        if sent < len(CONNECT_ESTABLISHED):
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(conn.client, CONNECT_ESTABLISHED[sent:])
        early = None if l7 else self.dialer.begin(pre, task, ruleset)
        conn.meta["tunnel"] = True  # from here a denial speaks the inner protocol
        try:
            inner = await self._flight(conn, deadline, initial=proxy.pending)
        except BaseException:
            if early is not None:
                await discard(early)
            raise
        return Tunnel(pre, early, inner)

    def _decide(
        self,
        conn: Conn,
        task: Task,
        ruleset: RuleSet,
        inner: Sniffed,
        proxy: ProxyHead,
        pre: FlowDecision | None,
    ) -> FlowDecision:
        orig = conn.meta["orig"]
        inp = FlowInput(
            listener=conn.listener,
            original_ip=orig[0] if orig else None,
            original_port=orig[1] if orig else None,
            connect=proxy.connect,
            tls=inner.tls,
            http=inner.http,
            sniff_error=inner.error,
            hint=inner.kind,
        )
        # with a CONNECT, the authority's verdict is reused when the inner flow names the
        # same host and port (the usual case): one rule-engine call per connection
        return decide_flow(inp, ruleset, task.profile, prior=pre)

    async def _follow(
        self, conn: Conn, task: Task, ruleset: RuleSet, route: Route, early: EarlyDial | None
    ) -> tuple[FlowDecision, DialResult] | None:
        action, d = route
        if early is not None and action != "early":
            await discard(early)
        if action == "refuse":
            await self._deny(conn, d)
            return None
        if action == "early":
            assert early is not None
            return d, await self.dialer.early_result(early)
        guarded = self.names.guard(task, d, ruleset)
        if guarded is not None:
            await self._deny_guarded(conn, d, guarded)
            return None
        if action == "dial":
            return d, await self.dialer.checked_dial(d, task, ruleset)
        result = await hand_over(conn, task, ruleset, d, self.dialer, self.inspector)
        if result[0] is not None:
            d = replace(d, allowed=True, reason=Reason.INSPECTED, report_only=False)
        return d, result

    def _start(
        self,
        conn: Conn,
        task: Task,
        decision: FlowDecision,
        upstream: socket.socket,
        dialled: str,
        inner: Sniffed,
        gate: tuple[RetryGate, int] | None,
    ) -> Started:
        """`gate`: a watched TLS tunnel's, with where its first ClientHello ends in the
        first bytes: only that much goes upstream now, the gate holds the rest."""
        elapsed = time.monotonic() - conn.started
        data, up_limit = first_bytes(inner, decision)
        if data and not self.table.count_up(task, len(data)):
            upstream.close()
            self.events.decision(conn, decision, dialled)
            raise UploadLimit
        # logged a moment later in a batch, off the latency path of the first upstream
        # byte; the close event is deferred the same way, so it still comes after this
        self.events.batch.defer(self.events.allowed, conn, decision, dialled, elapsed, time.time())
        # the sniffed bytes go upstream before the relay is even built: the upstream's
        # answer is the latency path, and the relay listens long before it can come
        # (readiness is level-triggered, so a reader registered later misses nothing)
        head = data if gate is None else data[: gate[1]]
        sent = send_some(upstream, head)
        count_up = functools.partial(self.table.count_up, task)
        relay = make_relay(conn, upstream, (head, sent, up_limit), count_up, self.pool,
                           self.loop, gate[0] if gate is not None else None)
        return Started(upstream, relay, decision, dialled)

    async def _flight(
        self, conn: Conn, deadline: float, *, initial: bytes = b"", http_only: bool = False
    ) -> Sniffed:
        flight = FirstFlight(self.settings.sniff_max_bytes, http_only=http_only, initial=initial)
        return await read_first_flight(conn.client, deadline, flight, self.loop)

    async def _deny_early(self, conn: Conn, reason: Reason, detail: str) -> None:
        """An explicit-proxy request refused before its task is looked at."""
        version = self.rules.current.version
        await self._deny(conn, FlowDecision(False, reason, "http", 0, policy_version=version,
                                            detail=detail))

    async def _deny_guarded(self, conn: Conn, d: FlowDecision, g: GuardDenial) -> None:
        # not logged when `g.log` is false: counted in a later event's suppressed_events
        # (guards.GuardDenial) and in the task's event totals
        await self._deny(conn, denial(d, g.reason, g.detail), extra=g.extra, log=g.log)

    async def _deny(
        self,
        conn: Conn,
        d: FlowDecision,
        status: int = 403,
        *,
        extra: dict[str, Any] | None = None,
        log: bool = True,
    ) -> None:
        """The one exit of a refused connection: its event, then its refusal."""
        self.events.decision(conn, d, None, extra=extra, emit=None if log else self.events.tally)
        await refuse(conn, d.reason, d.rule_id, d.protocol, status)


def locate_destination(conn: Conn) -> None:
    """The transparent connection's original destination (None for the proxy's) into
    `conn.meta["orig"]`. OSError: the socket failed first."""
    orig: tuple[str, int] | None = None
    if conn.listener == "transparent":
        orig = original_destination(conn.client)
        if orig is None:
            local = conn.client.getsockname()
            orig = (unmap_ip(local[0]), local[1])
        orig = (unmap_ip(orig[0]), orig[1])
    conn.meta["orig"] = orig
