"""The gateway's asyncio shell: accept, sniff, decide, resolve, dial, relay, log.

Only I/O lives here; every decision is made by pure code (`sniff_tls`, `sniff_http`,
`flow.decide_flow`, `AddressPolicy`). Two kinds of listener share one pipeline:

- transparent: the sandbox's TCP is redirected here by nftables; SO_ORIGINAL_DST gives
  the original destination, used for the port, the log and raw-TCP `cidr` rules only.
- proxy: explicit `HTTPS_PROXY` clients (CONNECT, and absolute-URI plain HTTP).

The gateway always resolves the allowed name itself and dials an address that passed
the special-purpose check; it never dials the client-chosen address for a named flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import itertools
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import date
from functools import lru_cache
from typing import Any

from stockade.policy.decide import decide_name, utc_today
from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from stockade.eager import start_eagerly
from stockade.events import make_event
from stockade.listen import parse_listen
from stockade.loops import every
from stockade.tasks import Task, TaskRegistry
from stockade.tcp import set_congestion_control

from .addresses import AddressPolicy
from .deny import CONNECT_ESTABLISHED, TLS_ALERT_ACCESS_DENIED, http_denial
from .dns.guards import GuardDenial, GuardState, NameLimits, name_violation
from .dns.settings import DnsSettings
from .flow import FlowDecision, FlowInput, Listener, Protocol, decide_flow
from .inspection import FlowMeta
from .metrics import GatewayMetrics
from .name_refusals import budget_denial, name_budget_summaries
from .original_dst import original_destination
from .relay import PipePool, Relay, UploadLimit, splice_works, wait_fd
from .resolver import Resolver
from .rulesource import RulesHolder
from .settings import GatewaySettings
from .sniff_common import NEED_MORE, SniffError
from .sniff_http import HttpSniffer, RequestHead, body_length, force_close, looks_like_http
from .sniff_tls import ClientHello, TlsSniffer, looks_like_tls

log = logging.getLogger("stockade.gateway")
Emit = Callable[[dict[str, Any]], None]
# (socket, dialled address, None) or (None, "", (reason, detail, http status))
DialResult = tuple[socket.socket | None, str, tuple[Reason, str, int] | None]
_ids = itertools.count(1)


@dataclass
class Sniffed:
    data: bytes = b""  # every byte read so far (replayed upstream unchanged)
    tls: ClientHello | None = None
    http: RequestHead | None = None
    error: SniffError | None = None
    kind: Protocol | None = None  # the sniffer the first byte chose


@dataclass(eq=False)
class Conn:
    """One accepted connection, tracked so deregistration/idle/shutdown can close it."""

    id: int
    listener: Listener
    client: socket.socket
    peer: tuple[str, int]
    started: float
    task: Task | None = None
    handler: asyncio.Task[None] | None = None
    last_activity: float = 0.0
    relaying: bool = False
    close_reason: str | None = None  # a Reason code, or "idle_timeout"
    meta: dict[str, Any] = field(default_factory=dict)

    def close(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason
        if self.handler is not None and not self.handler.done():
            self.handler.cancel()


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        *,
        rules: RulesHolder,
        registry: TaskRegistry,
        resolver: Resolver,
        address_policy: AddressPolicy,
        emit: Emit,
        metrics: GatewayMetrics | None = None,
        guards: GuardState | None = None,
        name_limits: NameLimits | None = None,
        tally: Emit | None = None,
    ) -> None:
        self.settings = settings
        self.rules = rules
        self.registry = registry
        self.resolver = resolver
        self.address_policy = address_policy
        self.emit = emit
        # counts an event not written (a name-budget refusal past the first) into the
        # task's event summaries and totals, as the DNS firewall's tally does
        self.tally: Emit = tally or _untallied
        self.metrics = metrics or GatewayMetrics()
        # the L7 inspector (InspectorSupervisor), set by the service when inspection is on
        self.inspector: Any = None
        # DNS-tunnelling guards for the names this path resolves; the service passes the
        # DNS firewall's GuardState so a task has one set of name budgets for both paths
        dns_defaults = DnsSettings()
        self.guards = guards or GuardState.from_settings(dns_defaults)
        self.name_limits = name_limits or NameLimits.from_settings(dns_defaults)
        # (task id, budget key) -> names being resolved right now, with a count each:
        # they count against the budget until they resolve (see `_checked_dial`)
        self._resolving: dict[tuple[str, str], dict[str, int]] = {}
        self.pool: PipePool | None = PipePool() if settings.splice and splice_works() else None
        self.conns: set[Conn] = set()
        self.by_task: dict[str, set[Conn]] = {}
        self.uploaded: dict[str, int] = {}  # task id -> bytes uploaded (all connections)
        self.bound: dict[Listener, list[tuple[str, int]]] = {"transparent": [], "proxy": []}
        self._servers: list[_Listening] = []
        self._sweeper: asyncio.Task[None] | None = None
        # events of allowed flows wait here for a moment and are built and written in one
        # batch, so that work is not on the latency path of the next connection (see
        # `_defer`); `stop()` writes whatever is left, so none is lost on shutdown
        self._deferred: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._flush_handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._decision_counters: dict[tuple[str, str, str], Any] = {}
        self._verdicts: dict[tuple[str, str, date], FlowDecision] = {}  # _connect_verdict
        self._verdicts_for: RuleSet | None = None
        registry.on_removed(self._task_removed)
        self.metrics.track_registry(lambda: len(self.registry))

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        for kind, addrs in (
            ("transparent", self.settings.transparent_listen),
            ("proxy", self.settings.proxy_listen),
        ):
            for addr in addrs:
                await self._listen(kind, addr)  # type: ignore[arg-type]
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def _listen(self, kind: Listener, addr: str) -> None:
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
                    max(1, math.ceil(self.settings.sniff_timeout_s)),
                )
        set_congestion_control(
            sock,
            self.settings.sandbox_congestion_control,
            "gateway.sandbox_congestion_control",
            log,
        )
        # accepted sockets inherit it (Linux): one setsockopt per listener, not per connection
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.listen(4096)
        sock.setblocking(False)
        self.bound[kind].append(sock.getsockname()[:2])
        listening = _Listening(sock, asyncio.get_running_loop())
        # accepting from a reader callback (not a task awaiting sock_accept) saves one
        # event-loop round per connection, and drains a burst of connections at once
        listening.start(lambda: self._accept(kind, listening))
        self._servers.append(listening)

    def _accept(self, kind: Listener, listening: _Listening) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                client, peer = listening.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                listening.pause(0.05)  # EMFILE and friends: back off, keep serving
                return
            self._spawn(kind, client, peer)

    def _spawn(self, kind: Listener, client: socket.socket, peer: tuple[Any, ...]) -> None:
        client.setblocking(False)
        now = time.monotonic()
        conn = Conn(next(_ids), kind, client, (_unmap(peer[0]), peer[1]), now, last_activity=now)
        self.conns.add(conn)
        # started here, not queued: its head is read, decided and answered in this
        # callback instead of after the rest of the loop iteration (see stockade.eager)
        conn.handler = start_eagerly(self._handle(conn))

    async def stop(self) -> None:
        for srv in self._servers:
            srv.close()
        if self._sweeper:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for conn in list(self.conns):
            conn.close(SHUTDOWN)
        handlers = [c.handler for c in list(self.conns) if c.handler]
        if handlers:
            await asyncio.gather(*handlers, return_exceptions=True)
        self.flush_events()
        if self.pool:
            self.pool.close()

    def status(self) -> dict[str, Any]:
        return {
            "connections": len(self.conns),
            "rules_version": self.rules.current.version,
            "splice": self.pool is not None,
            "inspector": None
            if self.inspector is None
            else {"ready": self.inspector.ready, "pid": self.inspector.pid},
        }

    # -- deferred events ---------------------------------------------------------------
    def _defer(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` (an event builder) a moment later, in a batch with others.

        Building and writing an event costs tens of microseconds; done inline it lands on
        the set-up latency of the flow itself or of the connection that arrives next. The
        batch starts at most EVENT_DELAY_S later (callers pass the wall-clock time of what
        they log, so timestamps are exact) and runs in order, EVENT_SLICE events per loop
        round so that connections arriving meanwhile wait for one slice, not the batch;
        `stop()` flushes everything.
        """
        self._deferred.append((fn, args))
        if self._flush_handle is None:
            loop = asyncio.get_running_loop()
            self._flush_handle = loop.call_later(EVENT_DELAY_S, self._flush_slice)

    def _flush_slice(self) -> None:
        self._flush_handle = None
        self._write_deferred(EVENT_SLICE)
        if self._deferred:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush_slice)

    def flush_events(self) -> None:
        """Build and write every deferred event now."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._write_deferred(len(self._deferred))

    def _write_deferred(self, limit: int) -> None:
        batch = self._deferred
        for _ in range(min(limit, len(batch))):
            fn, args = batch.popleft()
            try:
                fn(*args)
            except Exception:  # one bad event must not lose the rest of the batch
                log.exception("gateway: writing an event failed")

    # -- task lifecycle --------------------------------------------------------------
    def _task_removed(self, task: Task) -> None:
        for conn in list(self.by_task.get(task.task_id, ())):
            conn.close(Reason.TASK_ENDED)
        self.uploaded.pop(task.task_id, None)
        for ev in name_budget_summaries(self.guards, task):
            self.emit(ev)
        self.guards.forget(task.task_id)

    async def _sweep(self) -> None:
        """Expire tasks, close idle connections, pick up rule file changes: three loops,
        so an error in one (a full state disk fails expiry) stops neither of the others
        nor itself (stockade/loops.py logs it and runs the next round)."""
        poll = self.settings.rules_poll_interval_s
        await asyncio.gather(
            every(0.25, self.registry.expire, "gateway: task expiry", log),
            every(0.25, self._close_idle, "gateway: idle timeouts", log),
            every(poll, self._poll_rules, "gateway: rule file polling", log),
        )

    def _close_idle(self) -> None:
        now = time.monotonic()
        idle = self.settings.idle_timeout_s
        for conn in list(self.conns):
            if conn.relaying and now - conn.last_activity > idle:
                conn.close(IDLE_TIMEOUT)

    async def _poll_rules(self) -> None:
        if await asyncio.to_thread(self.rules.changed):
            self.rules.reload("file_change")

    # -- the pipeline ----------------------------------------------------------------
    async def _handle(self, conn: Conn) -> None:
        upstream: socket.socket | None = None
        relay: Relay | None = None
        decision: tuple[FlowDecision, str] | None = None
        try:
            upstream, relay, decision = await self._decide_and_dial(conn)
            if upstream is not None and relay is not None:
                conn.relaying = True
                self.metrics.live.inc()
                try:
                    await relay.run()
                finally:
                    self.metrics.live.dec()
        except asyncio.CancelledError:
            pass  # closed by deregistration, expiry, idle timeout or shutdown
        except UploadLimit:
            conn.close_reason = Reason.UPLOAD_LIMIT
        except OSError:
            pass  # a reset by either side ends the relay; the close event says so
        except Exception:
            # a bug must not take the listener down; the connection closes (fail closed)
            log.exception("connection %s: unexpected error", conn.id)
            conn.close_reason = conn.close_reason or "internal_error"
        finally:
            self._forget(conn)
            with contextlib.suppress(OSError):
                conn.client.close()
            if upstream is not None:
                with contextlib.suppress(OSError):
                    upstream.close()
            if relay is not None and decision is not None:
                self._defer(self._emit_close, conn, relay, *decision, time.time(), time.monotonic())

    def _forget(self, conn: Conn) -> None:
        self.conns.discard(conn)
        if conn.task is not None:
            group = self.by_task.get(conn.task.task_id)
            if group is not None:
                group.discard(conn)
                if not group:
                    del self.by_task[conn.task.task_id]

    async def _decide_and_dial(
        self, conn: Conn
    ) -> tuple[socket.socket | None, Relay | None, tuple[FlowDecision, str] | None]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.sniff_timeout_s
        orig: tuple[str, int] | None = None
        if conn.listener == "transparent":
            orig = original_destination(conn.client)
            if orig is None:
                local = conn.client.getsockname()
                orig = (_unmap(local[0]), local[1])
            orig = (_unmap(orig[0]), orig[1])
        conn.meta["orig"] = orig
        task = self.registry.by_address(conn.peer[0])
        conn.task = task

        connect_head: RequestHead | None = None
        if conn.listener == "proxy":
            head_sniff = await self._sniff(conn, deadline, http_only=True)
            if head_sniff.error is not None or head_sniff.http is None:
                err = head_sniff.error or SniffError(Reason.PROTOCOL_UNRECOGNISED, "no request")
                await self._deny_early(conn, err.reason, err.detail, "http")
                return None, None, None
            head = head_sniff.http
            if head.method == "CONNECT":
                connect_head = head
                pending = head_sniff.data[head.head_len :]
            elif head.form == "absolute":
                pending = b""
                inner = head_sniff
            else:
                await self._deny_early(
                    conn,
                    Reason.PROTOCOL_UNRECOGNISED,
                    "proxy request without an absolute URI",
                    "http",
                )
                return None, None, None
        if task is None:
            await self._deny_after_sniff(
                conn, Reason.UNKNOWN_TASK, "unknown source address", deadline, connect_head
            )
            return None, None, None
        group = self.by_task.setdefault(task.task_id, set())
        if len(group) >= self.settings.max_connections_per_task:
            await self._deny_after_sniff(
                conn,
                Reason.CONNECTION_LIMIT,
                "too many concurrent connections",
                deadline,
                connect_head,
            )
            return None, None, None
        group.add(conn)
        ruleset = self.rules.current

        early: EarlyDial | None = None
        if connect_head is not None:
            # decide on the authority alone first, so a denied CONNECT gets a 403
            pre = self._connect_verdict(connect_head, ruleset, task.profile)
            # the inspector decides per request, not this (a CONNECT alone is "tcp")
            l7 = pre.reason is Reason.INSPECTION_UNAVAILABLE and self._inspectable(pre, "tcp")
            if (not pre.allowed or pre.reason is Reason.INSPECTION_UNAVAILABLE) and not l7:
                pre = self._why_uninspected(pre)
                self._decision_event(conn, pre, None)
                await self._send_and_close(conn, http_denial(pre.reason, pre.rule_id, task.task_id))
                return None, None, None
            guarded = self._name_guard(task, pre, ruleset)
            if guarded is not None:  # refused before the 200: the client gets a 403
                return await self._deny_guarded(conn, pre, guarded)
            # the 200 first (the client's round trip is the latency path), then dial the
            # checked address of the allowed authority while the client sends its first
            # bytes; nothing is sent upstream unless the full decision agrees
            sent = _send_some(conn.client, CONNECT_ESTABLISHED)  # a new socket takes it all
            if sent < len(CONNECT_ESTABLISHED):
                await loop.sock_sendall(conn.client, CONNECT_ESTABLISHED[sent:])
            if not l7:
                early = self._begin_dial(pre, task, ruleset)
            conn.meta["tunnel"] = True  # from here a denial speaks the inner protocol
            try:
                inner = await self._sniff(conn, deadline, initial=pending)
            except BaseException:
                if early is not None:
                    await _discard(early)
                raise
        elif conn.listener == "transparent":
            inner = await self._sniff(conn, deadline)
        inp = FlowInput(
            listener=conn.listener,
            original_ip=orig[0] if orig else None,
            original_port=orig[1] if orig else None,
            connect=connect_head,
            tls=inner.tls,
            http=inner.http,
            sniff_error=inner.error,
            hint=inner.kind,
        )
        # with a CONNECT, the authority's verdict is reused when the inner flow names the
        # same host and port (the usual case): one rule-engine call per connection
        decision = decide_flow(
            inp, ruleset, task.profile, prior=pre if connect_head is not None else None
        )
        if (
            decision.allowed
            and decision.protocol == "http"
            and inner.http is not None
            and body_length(inner.http) is None
        ):
            # only the first request of a plain-HTTP connection is decided, and the relay
            # forwards exactly its head and body: a body it cannot count is refused
            decision = replace(
                decision,
                allowed=False,
                reason=Reason.PROTOCOL_UNRECOGNISED,
                report_only=False,
                detail="plain-HTTP request body without a plain Content-Length (chunked)",
            )
        if decision.reason is Reason.INSPECTION_UNAVAILABLE and self._inspectable(decision):
            # method/path rules on a TLS flow: resolved and checked here, decided per
            # request by the inspector (gateway/inspection.py)
            if early is not None:
                await _discard(early)
            guarded = self._name_guard(task, decision, ruleset)
            if guarded is not None:
                return await self._deny_guarded(conn, decision, guarded)
            result = await self._inspect(conn, task, ruleset, decision)
            if result[0] is not None:
                decision = replace(
                    decision, allowed=True, reason=Reason.INSPECTED, report_only=False
                )
        elif not decision.allowed or decision.reason is Reason.INSPECTION_UNAVAILABLE:
            # (report mode lets a policy denial through, never a flow that needs the
            # inspector while it is down or disabled: the Host/SNI checks inside TLS and
            # the per-request decisions would be skipped)
            if early is not None:
                await _discard(early)
            decision = self._why_uninspected(decision)
            self._decision_event(conn, decision, None)
            await self._refuse(conn, decision.reason, decision.rule_id, decision.protocol)
            return None, None, None
        elif early is not None and (pre.host, pre.ip, pre.port) == (
            decision.host,
            decision.ip,
            decision.port,
        ):
            result = await self._early_result(early)  # the name passed the guards already
        else:
            if early is not None:
                await _discard(early)
            guarded = self._name_guard(task, decision, ruleset)
            if guarded is not None:
                return await self._deny_guarded(conn, decision, guarded)
            result = await self._checked_dial(decision, task, ruleset)
        upstream, dialled, failure = result
        if upstream is None:
            assert failure is not None
            reason, detail, status = failure
            return await self._deny_resolved(conn, decision, reason, detail, status=status)
        elapsed = time.monotonic() - conn.started
        up_limit: int | None = None
        if inner.http is not None and decision.protocol == "http":
            # one decided request per plain-HTTP connection (see sniff_http.force_close):
            # its head and Content-Length body go upstream, nothing the client sends after
            # (a pipelined second request) is ever read from it
            closed = force_close(inner.http, inner.data)
            head_len = inner.http.head_len + len(closed) - len(inner.data)
            up_limit = head_len + (body_length(inner.http) or 0)
            inner.data = closed[:up_limit]
        if inner.data and not self._count_up(task, len(inner.data)):
            upstream.close()
            self._decision_event(conn, decision, dialled)
            raise UploadLimit
        # logged a moment later in a batch, off the latency path of the first upstream
        # byte; the close event is deferred the same way, so it still comes after this
        self._defer(self._allowed_event, conn, decision, dialled, elapsed, time.time())
        # the sniffed bytes go upstream before the relay is even built: the upstream's
        # answer is the latency path, and the relay listens long before it can come
        # (readiness is level-triggered, so a reader registered later misses nothing)
        sent = _send_some(upstream, inner.data)
        relay = Relay(
            conn.client,
            upstream,
            count_up=lambda n: self._count_up(task, n),
            pool=self.pool,
            on_activity=lambda: _touch(conn),
            first=inner.data,
            first_sent=sent,
            up_limit=up_limit,
        )
        return upstream, relay, (decision, dialled)

    def _inspectable(self, d: FlowDecision, protocol: str = "tls") -> bool:
        """Does this flow go to the L7 inspector? A named TLS flow whose matching allow
        entries are all inspected (an `http` block, or `host_must_match_sni`: denied
        `inspection_unavailable`, or let through in report mode), while the inspector is
        up. Everything else never touches it."""
        return (
            d.reason == Reason.INSPECTION_UNAVAILABLE
            and d.protocol == protocol
            and d.host is not None
            and d.ip is None
            and self.inspector is not None
            and self.inspector.ready
        )

    def _why_uninspected(self, d: FlowDecision) -> FlowDecision:
        """A denial `inspection_unavailable` with the inspector's state in its detail."""
        if d.reason != Reason.INSPECTION_UNAVAILABLE:
            return d
        d = replace(d, allowed=False, report_only=False)  # enforced in report mode too
        if self.inspector is None:
            why = "L7 inspection is disabled (gateway.inspection.enabled)"
        elif d.protocol == "http":
            why = "the plain-HTTP request head gives no path to decide on"
        else:
            why = self.inspector.why or "the inspector is not ready"
        return replace(d, detail=f"{d.detail}: {why}" if d.detail else why)

    async def _inspect(
        self, conn: Conn, task: Task, ruleset: RuleSet, d: FlowDecision
    ) -> DialResult:
        """Resolve and check like any flow, then hand the checked address to the inspector
        (never the name, never the client's destination). The result's socket is the
        inspector's end of the tunnel; the relay runs between it and the client."""
        _, checked, failure = await self._checked_dial(d, task, ruleset, connect=False)
        if failure is not None:
            return None, "", failure
        assert d.host is not None
        addresses = checked.split()
        ip = addresses[0]
        if len(addresses) > 1:
            # the inspector dials one address, lazily: pick the first that accepts a
            # connection (as _dial does for every other flow) before handing it over
            probe, ip = await self._dial(addresses, d.port)
            if probe is None:
                detail = "no checked address accepted the connection"
                return None, "", (Reason.UPSTREAM_UNREACHABLE, detail, 502)
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
            sock = await self.inspector.handoff(meta)
        except Exception as e:  # InspectorUnavailable, or a meta that cannot be encoded
            return None, "", (Reason.INSPECTION_UNAVAILABLE, str(e) or type(e).__name__, 403)
        return sock, ip, None

    def _connect_verdict(self, head: RequestHead, ruleset: RuleSet, profile: str) -> FlowDecision:
        """`decide_flow` for a CONNECT authority alone, memoised per rule set, profile,
        authority and UTC day (it is pure in exactly those: entries expire by date). A
        task names the same few authorities on every connection. Bounded: cleared when
        full, so distinct names can churn it but not grow it."""
        if ruleset is not self._verdicts_for:
            self._verdicts.clear()
            self._verdicts_for = ruleset
        today = utc_today()
        key = (profile, head.target, today)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if len(self._verdicts) >= VERDICT_CACHE_SIZE:
                self._verdicts.clear()
            verdict = decide_flow(FlowInput("proxy", connect=head), ruleset, profile, today)
            self._verdicts[key] = verdict
        return verdict

    def _count_up(self, task: Task, n: int) -> bool:
        used = self.uploaded.get(task.task_id, 0) + n
        self.uploaded[task.task_id] = used
        ruleset = self.rules.current
        profile = ruleset.profiles.get(task.profile)
        cap = profile.limits.egress_bytes if profile is not None else 0
        return used <= cap

    def _name_guard(self, task: Task, d: FlowDecision, ruleset: RuleSet) -> GuardDenial | None:
        """The DNS firewall's tunnelling guards for a name this path is about to resolve:
        why it must not be, else None. Enforced in report mode too, as on the DNS path:
        they guard the resolver, not the policy."""
        if d.host is None:
            return None  # a literal address (cidr rule): nothing is resolved
        bad = name_violation(d.host, self.name_limits)
        if bad is not None:
            return GuardDenial(bad, "the name looks like a tunnelling channel; not resolved")
        now = time.monotonic()
        rule = _budget_key(ruleset, task, d.host)
        over = self.guards.admit_name(task.task_id, ruleset, task.profile, d.host, rule, now)
        if over is not None:
            return budget_denial(self.guards, task.task_id, rule or "", over, now)
        # on a cache miss the upstream query itself would carry the data out
        if self.resolver.cached(d.host, now) is None and self.guards.unresolvable_exhausted(
            task.task_id, rule or "", d.host, now
        ):
            return GuardDenial(
                Reason.UNRESOLVABLE_NAME_BUDGET,
                "too many distinct unresolvable names under this allow entry",
            )
        return None

    async def _checked_dial(
        self,
        d: FlowDecision,
        task: Task | None = None,
        ruleset: RuleSet | None = None,
        *,
        connect: bool = True,
    ) -> DialResult:
        """Resolve (names) or check (cidr literals) and connect to a checked address.
        `connect=False`: only resolve and check; the result is (None, the checked
        addresses separated by spaces, None) for `_inspect`."""
        candidates: list[str]
        if d.ip is not None:
            category = self.address_policy.check(d.ip)
            if category is not None:
                return None, "", (Reason.ADDRESS_FORBIDDEN, f"address category {category}", 403)
            candidates = [d.ip]
        else:
            assert d.host is not None
            host = d.host
            pending: dict[str, int] | None = None
            if task is not None and ruleset is not None and self.resolver.cached(host) is None:
                # the authoritative budget check: synchronous with registering the name as
                # in flight, so concurrent connections cannot all slip under the cap
                rule = _budget_key(ruleset, task, host)
                key = (task.task_id, rule)
                pending = self._resolving.setdefault(key, {})
                now = time.monotonic()
                if self.guards.unresolvable_exhausted_pending(
                    task.task_id, rule, host, now, pending
                ):
                    if not pending:
                        del self._resolving[key]
                    detail = "too many distinct unresolvable names under this allow entry"
                    return None, "", (Reason.UNRESOLVABLE_NAME_BUDGET, detail, 403)
                pending[host] = pending.get(host, 0) + 1
            try:
                res = await self.resolver.resolve(host)
            finally:
                if pending is not None:
                    left = pending[host] - 1
                    if left:
                        pending[host] = left
                    else:
                        del pending[host]
                        if not pending:
                            self._resolving.pop(key, None)
            unresolvable = res.error is not None or (not res.addresses and not res.forbidden)
            if unresolvable and task is not None and ruleset is not None:
                # counts against the task's budget exactly as a DNS query would
                rule = _budget_key(ruleset, task, d.host)
                self.guards.record_unresolvable(task.task_id, rule, d.host, time.monotonic())
            if not res.addresses:
                if res.forbidden:
                    cats = ", ".join(sorted({c for _, c in res.forbidden}))
                    detail = f"name resolves only to forbidden addresses ({cats})"
                    return None, "", (Reason.ADDRESS_FORBIDDEN, detail, 403)
                detail = f"resolution failed: {res.error or 'no address'}"
                return None, "", (Reason.RESOLVE_FAILED, detail, 403)
            candidates = list(res.addresses)
        if not connect:
            return None, " ".join(candidates), None
        sock, ip = await self._dial(candidates, d.port)
        if sock is None:
            detail = "no checked address accepted the connection"
            return None, "", (Reason.UPSTREAM_UNREACHABLE, detail, 502)
        return sock, ip, None

    def _begin_dial(self, d: FlowDecision, task: Task, ruleset: RuleSet) -> EarlyDial:
        """Start `_checked_dial` for a CONNECT authority while the client sends its first
        bytes. When the name is in the resolver cache (the usual case) the upstream
        handshake starts right here and is finished inline by `_early_result` (no task:
        a task's first step would only run at the caller's next await, and waiting on it
        costs event-loop rounds); otherwise a task resolves and dials."""
        res = self.resolver.cached(d.host) if d.ip is None and d.host is not None else None
        if res is not None and res.addresses:
            self.resolver.hits += 1  # what resolve() counts for a cached answer
            ip = res.addresses[0]  # checked addresses only (the resolver filters them)
            sock = _stream_socket(ip)
            try:
                err = sock.connect_ex((ip, d.port))
            except OSError:
                sock.close()
            else:
                return EarlyDial(None, (sock, err), list(res.addresses), d.port)
        return EarlyDial(asyncio.ensure_future(self._checked_dial(d, task, ruleset)))

    async def _early_result(self, early: EarlyDial) -> DialResult:
        if early.task is not None:
            return await early.task
        assert early.started is not None
        started, early.started = early.started, None  # from here _dial owns the socket
        return await self._finish_dial(early.addresses, early.port, started)

    async def _finish_dial(
        self, addresses: list[str], port: int, started: tuple[socket.socket, int]
    ) -> DialResult:
        sock, ip = await self._dial(addresses, port, started)
        if sock is None:
            detail = "no checked address accepted the connection"
            return None, "", (Reason.UPSTREAM_UNREACHABLE, detail, 502)
        return sock, ip, None

    async def _dial(
        self,
        addresses: list[str],
        port: int,
        started: tuple[socket.socket, int] | None = None,
    ) -> tuple[socket.socket | None, str]:
        """Connect to the first address that accepts. `started`: the socket and
        connect_ex result of a connect to `addresses[0]` already under way."""
        loop = asyncio.get_running_loop()
        for i, ip in enumerate(addresses):
            err: int | None = None
            if i == 0 and started is not None:
                sock, err = started
            else:
                sock = _stream_socket(ip)
            deadline = loop.time() + self.settings.connect_timeout_s
            try:
                await _connect(loop, sock, (ip, port), err, deadline)
            except (OSError, TimeoutError):
                sock.close()
                continue
            except BaseException:
                sock.close()
                raise
            return sock, ip
        return None, ""

    # -- sniffing ----------------------------------------------------------------------
    async def _sniff(
        self, conn: Conn, deadline: float, *, initial: bytes = b"", http_only: bool = False
    ) -> Sniffed:
        loop = asyncio.get_running_loop()
        out = Sniffed(data=initial)
        cap = self.settings.sniff_max_bytes
        sniffer: TlsSniffer | HttpSniffer | None = None
        buf = bytearray(initial)
        pending_feed = bytes(initial)
        while True:
            if buf and sniffer is None:
                if looks_like_tls(buf) and not http_only:
                    sniffer = TlsSniffer(cap)
                    out.kind = "tls"
                elif looks_like_http(buf):
                    sniffer = HttpSniffer(cap)
                    out.kind = "http"
                else:
                    out.error = SniffError(Reason.PROTOCOL_UNRECOGNISED, "neither TLS nor HTTP")
                    break
            if sniffer is not None and pending_feed:
                r = sniffer.feed(pending_feed)
                pending_feed = b""
                if r is not NEED_MORE:
                    if isinstance(r, SniffError):
                        out.error = r
                    elif isinstance(r, ClientHello):
                        out.tls = r
                    elif isinstance(r, RequestHead):
                        out.http = r
                    break
            remaining = deadline - loop.time()
            if remaining <= 0:
                out.error = SniffError(
                    Reason.SNIFF_TIMEOUT,
                    "no complete ClientHello or request head before the deadline",
                )
                break
            try:
                try:
                    chunk = conn.client.recv(16384)  # usually already there: no loop round
                except BlockingIOError:
                    await wait_fd(loop, conn.client.fileno(), False, deadline)
                    continue  # readable (or closed): the recv above reads it
            except TimeoutError:
                out.error = SniffError(
                    Reason.SNIFF_TIMEOUT,
                    "no complete ClientHello or request head before the deadline",
                )
                break
            except OSError:
                chunk = b""
            if not chunk:
                out.error = SniffError(
                    Reason.PROTOCOL_UNRECOGNISED,
                    "client closed before the first message was complete",
                )
                break
            buf += chunk
            pending_feed = chunk
            if len(buf) > 2 * cap + 64:
                out.error = SniffError(Reason.HEAD_TOO_LARGE, "first message exceeds the cap")
                break
        out.data = bytes(buf)
        return out

    # -- denials -------------------------------------------------------------------------
    async def _deny_early(self, conn: Conn, reason: Reason, detail: str, protocol: str) -> None:
        ruleset = self.rules.current
        d = FlowDecision(
            False,
            reason,
            "http" if protocol == "http" else "tcp",
            0,
            policy_version=ruleset.version,
            detail=detail,
        )
        self._decision_event(conn, d, None)
        tid = conn.task.task_id if conn.task else None
        await self._send_and_close(conn, http_denial(reason, None, tid))

    async def _deny_after_sniff(
        self,
        conn: Conn,
        reason: Reason,
        detail: str,
        deadline: float,
        connect_head: RequestHead | None,
    ) -> None:
        """Deny before any policy work, in the client's own protocol where it can be told."""
        protocol: Protocol = "http"
        if connect_head is None and conn.listener == "transparent":
            sniffed = await self._sniff(conn, deadline)
            protocol = sniffed.kind or "tcp"
        d = FlowDecision(
            False,
            reason,
            protocol,
            conn.meta["orig"][1] if conn.meta.get("orig") else 0,
            policy_version=self.rules.current.version,
            detail=detail,
        )
        self._decision_event(conn, d, None)
        tid = conn.task.task_id if conn.task else None
        await self._refuse(conn, reason, None, protocol, task_id=tid)

    async def _deny_guarded(
        self, conn: Conn, decision: FlowDecision, g: GuardDenial
    ) -> tuple[None, None, None]:
        return await self._deny_resolved(
            conn, decision, g.reason, g.detail, extra=g.extra, log=g.log
        )

    async def _deny_resolved(
        self,
        conn: Conn,
        decision: FlowDecision,
        reason: Reason,
        detail: str,
        status: int = 403,
        *,
        extra: dict[str, Any] | None = None,
        log: bool = True,
    ) -> tuple[None, None, None]:
        d = FlowDecision(
            False,
            reason,
            decision.protocol,
            decision.port,
            host=decision.host,
            ip=decision.ip,
            rule_id=decision.rule_id,
            policy_version=decision.policy_version,
            detail=detail,
        )
        # not logged: counted in a later event's suppressed_events (guards.GuardDenial) and
        # in the task's event totals
        self._decision_event(conn, d, None, extra=extra, emit=None if log else self.tally)
        await self._refuse(conn, reason, decision.rule_id, decision.protocol, status=status)
        return None, None, None

    async def _refuse(
        self,
        conn: Conn,
        reason: Reason,
        rule: str | None,
        protocol: str,
        status: int = 403,
        task_id: str | None = None,
    ) -> None:
        tid = task_id or (conn.task.task_id if conn.task else None)
        if protocol == "tls":
            payload = TLS_ALERT_ACCESS_DENIED
        elif protocol == "http" or (conn.listener == "proxy" and not conn.meta.get("tunnel")):
            payload = http_denial(reason, rule, tid, status=status)
        else:
            payload = b""
        await self._send_and_close(conn, payload)

    async def _send_and_close(self, conn: Conn, payload: bytes) -> None:
        loop = asyncio.get_running_loop()
        if payload:
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(loop.sock_sendall(conn.client, payload), 2.0)
        with contextlib.suppress(OSError):
            conn.client.shutdown(socket.SHUT_WR)

    # -- events ----------------------------------------------------------------------
    def _allowed_event(
        self, conn: Conn, d: FlowDecision, dialled: str, elapsed: float, now: float
    ) -> None:
        self.metrics.decision_seconds.observe(elapsed)
        self._decision_event(conn, d, dialled, now)

    def _count_decision(self, outcome: str, reason: str, profile: str) -> None:
        # labels() takes a lock and builds a tuple per call; the label space is small
        key = (outcome, reason, profile)
        child = self._decision_counters.get(key)
        if child is None:
            if len(self._decision_counters) > 4096:
                self._decision_counters.clear()
            child = self._decision_counters[key] = self.metrics.decisions.labels(*key)
        child.inc()

    def _decision_event(
        self,
        conn: Conn,
        d: FlowDecision,
        dialled: str | None,
        now: float | None = None,
        extra: dict[str, Any] | None = None,
        emit: Emit | None = None,
    ) -> dict[str, Any]:
        task = conn.task
        profile = task.profile if task else None
        orig = conn.meta.get("orig")
        outcome = "allowed" if d.allowed else "denied"
        self._count_decision(outcome, str(d.reason), profile or "")
        extra = {**(extra or {}), "listener": conn.listener, "connection_id": conn.id}
        if orig is not None:
            extra["original_destination"] = f"{orig[0]}:{orig[1]}"
        ev = make_event(
            component="gateway",
            action="connection_decision",
            decision=outcome,
            reason=str(d.reason),
            task_id=task.task_id if task else None,
            profile=profile,
            policy_version=d.policy_version or None,
            rule_id=d.rule_id,
            report_only=d.report_only,
            source_ip=conn.peer[0],
            source_port=conn.peer[1],
            destination_domain=d.host,
            destination_ip=dialled,
            destination_port=d.port or None,
            transport="tcp",
            protocol=d.protocol,
            message=d.detail or None,
            extra=extra,
            now=now,
        )
        (emit or self.emit)(ev)
        return ev

    def _emit_close(
        self,
        conn: Conn,
        relay: Relay,
        d: FlowDecision,
        dialled: str,
        now: float | None = None,
        ended: float | None = None,
    ) -> None:
        self.metrics.bytes_up.inc(relay.bytes_up)
        self.metrics.bytes_down.inc(relay.bytes_down)
        reason = conn.close_reason
        task = conn.task
        ended = time.monotonic() if ended is None else ended
        self.emit(
            make_event(
                component="gateway",
                action="connection_close",
                decision="denied" if reason in (Reason.UPLOAD_LIMIT, Reason.TASK_ENDED) else None,
                reason=reason or "closed",
                task_id=task.task_id if task else None,
                profile=task.profile if task else None,
                policy_version=d.policy_version or None,
                rule_id=d.rule_id,
                source_ip=conn.peer[0],
                source_port=conn.peer[1],
                destination_domain=d.host,
                destination_ip=dialled or None,
                destination_port=d.port or None,
                transport="tcp",
                protocol=d.protocol,
                extra={
                    "bytes_up": relay.bytes_up,
                    "bytes_down": relay.bytes_down,
                    "duration_s": round(ended - conn.started, 6),
                    "connection_id": conn.id,
                },
                now=now,
            )
        )


# close reasons only (not decisions), so not Reason codes
IDLE_TIMEOUT = "idle_timeout"
SHUTDOWN = "shutdown"
ACCEPT_BATCH = 64  # connections accepted per readiness callback before yielding
EVENT_DELAY_S = 0.01  # how long an allowed flow's events may wait to be written in a batch
VERDICT_CACHE_SIZE = 4096  # memoised CONNECT verdicts (see Gateway._connect_verdict)
EVENT_SLICE = 4  # deferred events written per event-loop round


def _untallied(_event: dict[str, Any]) -> None:
    return None


def _budget_key(ruleset: RuleSet, task: Task, host: str) -> str:
    """The allow entry a name's budgets are kept under: the one the DNS firewall charges
    (`decide_name`), so both paths draw from the same budgets."""
    return decide_name(ruleset, task.profile, host).rule_id or ""


_IN_PROGRESS = (errno.EINPROGRESS, errno.EINTR, errno.EAGAIN)


def _send_some(sock: socket.socket, data: bytes) -> int:
    """What one non-blocking send takes of `data` (0 on any error: the relay sends the
    rest, and meets the error itself)."""
    if not data:
        return 0
    try:
        return sock.send(data)
    except OSError:
        return 0


def _stream_socket(ip: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


async def _connect(
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
    if err is None:  # else: connect_ex already ran (see Gateway._begin_dial)
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


@dataclass
class EarlyDial:
    """A CONNECT's dial begun before its inner bytes were decided: a task (the name had
    to be resolved first), or a socket whose handshake is under way."""

    task: asyncio.Future[DialResult] | None
    started: tuple[socket.socket, int] | None = None  # (socket, connect_ex result)
    addresses: list[str] = field(default_factory=list)
    port: int = 0


async def _discard(early: EarlyDial) -> None:
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


def _touch(conn: Conn) -> None:
    conn.last_activity = time.monotonic()


@lru_cache(maxsize=4096)
def _unmap(ip: str) -> str:
    """'::ffff:10.0.0.1' -> '10.0.0.1' so registry lookups and logs use one form."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return str(addr.ipv4_mapped)
    return str(addr)


class _Listening:
    """A listening socket and its reader callback (what `stop()` closes)."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
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

        def resume() -> None:
            self._resume = None
            if not self.closed and self.on_ready is not None:
                self.loop.add_reader(self.sock.fileno(), self.on_ready)

        self._resume = self.loop.call_later(seconds, resume)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._resume is not None:
            self._resume.cancel()
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
