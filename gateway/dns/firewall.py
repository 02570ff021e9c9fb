"""The DNS firewall's asyncio shell: UDP and TCP listeners that only move bytes.

Every decision is made by `decide.py`; this module parses, looks the task up by source
address, consults the shared resolver, encodes, sends, emits the event and counts. A
cached answer is computed synchronously inside `datagram_received` (no task per packet),
which is what keeps the cached path fast; only cache misses spawn a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from dnslib import RCODE
from prometheus_client import CollectorRegistry, Counter
from stockade.policy import Reason
from stockade.policy.ruleset import RuleSet

from stockade.net.resolver import Resolver, parse_server
from stockade.tasks.registry import Task, TaskRegistry

from .decide import (
    NeedResolve,
    Outcome,
    before_upstream,
    conclude,
    outcome_event,
    precheck,
    summary_outcomes,
)
from .drops import DropReporter, read_drops
from .guards import GuardState
from .packet import MAX_TCP_SIZE, Malformed, Query, Reply, build_response, parse_query
from .settings import DnsSettings
from .shares import Shares

log = logging.getLogger("stockade.dns")

Transport = Literal["udp", "tcp"]
Emit = Callable[[dict[str, Any]], None]
RulesSource = RuleSet | Callable[[], RuleSet | None] | None


class DnsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queries = Counter(
            "stockade_dns_queries",
            "DNS queries by outcome and reason",
            ["outcome", "reason", "transport"],
            registry=registry,
        )
        self.malformed = Counter(
            "stockade_dns_malformed_packets", "DNS packets dropped as malformed", registry=registry
        )
        self.cache_hits = Counter(
            "stockade_dns_cache_hits",
            "DNS answers served from the resolver cache",
            registry=registry,
        )
        self.cache_misses = Counter(
            "stockade_dns_cache_misses",
            "DNS answers that needed an upstream lookup",
            registry=registry,
        )
        self.truncated = Counter(
            "stockade_dns_truncated", "UDP answers sent with TC set", registry=registry
        )
        self._children: dict[tuple[str, str, str], Any] = {}

    def count(self, outcome: str, reason: str, transport: str) -> None:
        # labels() costs a lock and a tuple build per call; the label space is small
        key = (outcome, reason, transport)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.queries.labels(outcome, reason, transport)
        child.inc()


class DnsFirewall:
    def __init__(
        self,
        settings: DnsSettings,
        resolver: Resolver,
        registry: TaskRegistry,
        rules: RulesSource,
        emit: Emit,
        metrics_registry: CollectorRegistry | None = None,
        tally: Emit | None = None,
    ) -> None:
        self.settings = settings
        self.resolver = resolver
        self.registry = registry
        self._rules = rules
        self.emit = emit
        # counts an event not written (rate-limited queries) into the task's summaries
        self.tally = tally
        self._drop_timer: asyncio.TimerHandle | None = None
        self.metrics_registry = metrics_registry or CollectorRegistry()
        self.metrics = DnsMetrics(self.metrics_registry)
        self.guards = GuardState.from_settings(settings)
        self._udp: list[_UdpListener] = []
        self._tcp: list[asyncio.Server] = []
        self._tcp_shares = Shares(settings.max_tcp_connections,
                                  settings.max_tcp_connections_per_task)
        self._pending: set[asyncio.Task[None]] = set()
        self._throttled: dict[tuple[str, str], tuple[float, int]] = {}
        registry.on_removed(self.task_removed)

    # -- rules ---------------------------------------------------------------------
    @property
    def rules(self) -> RuleSet | None:
        r = self._rules
        if r is None or isinstance(r, RuleSet):
            return r
        try:
            return r()
        except Exception:  # no rules loaded yet: every query is refused (fail closed)
            return None

    def set_rules(self, rules: RulesSource) -> None:
        self._rules = rules

    def task_removed(self, task: Task) -> None:
        """Write the task's name-budget summaries and forget it (again: a no-op)."""
        # (`guards` is looked up here, not bound earlier: the service may replace it)
        for out in summary_outcomes(self.guards, task, self.settings):
            self._emit(outcome_event(None, out, task, None, None, "udp"))
        self.guards.forget(task.task_id)

    # -- lifecycle -----------------------------------------------------------------
    @property
    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) actually bound, UDP first (ports may have been 0 in settings)."""
        return [u.sockname() for u in self._udp]

    async def start(self) -> None:
        try:
            for spec in self.settings.listen:
                host, port = parse_server(spec)
                listener = _UdpListener(self, host, port)
                self._udp.append(listener)
                bound = listener.sockname()[1]
                server = await asyncio.start_server(self._serve_tcp, host, bound)
                self._tcp.append(server)
            self._check_drops()
        except BaseException:
            await self.stop()
            raise

    def _check_drops(self, final: bool = False) -> None:
        """Report datagrams the kernel dropped (every second; all that is left at stop)."""
        for u in self._udp:
            ev = u.drops.reading(read_drops(u.sock), time.time(), final=final)
            if ev is not None:
                self._emit(ev)
        if self._drop_timer is not None:
            self._drop_timer.cancel()
        self._drop_timer = None
        if not final:
            self._drop_timer = asyncio.get_running_loop().call_later(1.0, self._check_drops)

    async def stop(self) -> None:
        self._check_drops(final=True)
        for t in self._udp:
            t.close()
        for s in self._tcp:
            s.close()
        for s in self._tcp:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(s.wait_closed(), 1.0)
        for task in list(self._pending):
            task.cancel()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        self._udp, self._tcp = [], []

    # -- the query path ------------------------------------------------------------
    def answer_now(
        self, data: bytes, source: tuple[str, int], transport: Transport
    ) -> tuple[bytes | None, tuple[Query, Task, RuleSet, NeedResolve] | None]:
        """Decide synchronously when possible. Returns (reply bytes, None) when done, or
        (None, pending) when the name must be resolved upstream first."""
        now = time.monotonic()
        try:
            q = parse_query(data)
        except Malformed:
            self.metrics.malformed.inc()
            self._malformed_event(source, transport, now)
            return None, None  # dropped and counted: never answer what we cannot parse
        task = self.registry.by_address(source[0])
        rules = self.rules
        step = precheck(q, task, rules, self.settings, self.guards, now)
        if isinstance(step, Outcome):
            return self._finish(q, task, step, source, transport), None
        assert task is not None and rules is not None
        res = self.resolver.cached(step.name, now)
        if res is None:
            blocked = before_upstream(task, step, self.settings, self.guards, now)
            if blocked is not None:
                return self._finish(q, task, blocked, source, transport), None
            return None, (q, task, rules, step)
        self.metrics.cache_hits.inc()
        self.resolver.hits += 1
        out = conclude(q, task, rules, step, res, self.settings, self.guards, now)
        return self._finish(q, task, out, source, transport), None

    async def answer_later(
        self,
        pending: tuple[Query, Task, RuleSet, NeedResolve],
        source: tuple[str, int],
        transport: Transport,
    ) -> bytes | None:
        q, task, rules, step = pending
        self.metrics.cache_misses.inc()
        res = await self.resolver.resolve(step.name)
        out = conclude(q, task, rules, step, res, self.settings, self.guards, time.monotonic())
        return self._finish(q, task, out, source, transport)

    def _finish(
        self,
        q: Query,
        task: Task | None,
        out: Outcome,
        source: tuple[str, int],
        transport: Transport,
    ) -> bytes | None:
        self.metrics.count(out.decision, str(out.reason), transport)
        if out.log and (out.decision == "denied" or self.settings.log_allowed or out.report_only):
            if task is None or task.pooled:
                # no task (or a pooled sandbox's, denied before any budget): no per-task
                # rate budget, so throttle per source instead
                suppressed = self._throttle((source[0], str(out.reason)), time.monotonic())
                if suppressed is not None:
                    if suppressed:
                        out = replace(out, extra={**out.extra, "suppressed_events": suppressed})
                    self._emit(outcome_event(q, out, task, source[0], source[1], transport))
            else:
                self._emit(outcome_event(q, out, task, source[0], source[1], transport))
        elif task is not None and out.decision == "denied" and self.tally is not None:
            self.tally(outcome_event(q, out, task, source[0], source[1], transport))
        if out.reply is None:
            return None
        limit = q.udp_size if transport == "udp" else MAX_TCP_SIZE
        data, truncated = build_response(q, out.reply, limit, self.settings.edns_udp_payload)
        if truncated:
            self.metrics.truncated.inc()
        return data

    def _throttle(self, key: tuple[str, str], now: float) -> int | None:
        """Events keyed by (source, kind) at most once a second: a flood from an
        unregistered or misbehaving source must not flood the log. Returns the number
        suppressed since the last one, or None when this one is suppressed."""
        last, suppressed = self._throttled.get(key, (-1e9, 0))
        if now - last < 1.0:
            self._throttled[key] = (last, suppressed + 1)
            return None
        if len(self._throttled) > 4096:
            self._throttled.clear()
        self._throttled[key] = (now, 0)
        return suppressed

    def _malformed_event(self, source: tuple[str, int], transport: Transport, now: float) -> None:
        suppressed = self._throttle((source[0], "malformed"), now)
        if suppressed is None:
            return
        task = self.registry.by_address(source[0])
        out = Outcome(
            "denied",
            Reason.MALFORMED_QUERY,
            None,
            message="malformed DNS packet dropped",
            extra={"suppressed_events": suppressed} if suppressed else {},
        )
        self._emit(outcome_event(None, out, task, source[0], source[1], transport))

    def _emit(self, event: dict[str, Any]) -> None:
        try:
            self.emit(event)
        except Exception:  # an event sink failure must not take DNS down
            log.exception("dns: emitting an event failed")

    def _overloaded(self, q_data: bytes) -> bytes | None:
        # too many upstream lookups in flight: SERVFAIL now rather than queue without bound
        try:
            q = parse_query(q_data)
        except Malformed:
            return None
        self.metrics.count("denied", "upstream_unreachable", "udp")
        return build_response(q, Reply(RCODE.SERVFAIL), q.udp_size)[0]

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # -- TCP -----------------------------------------------------------------------
    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = (str(peer[0]), int(peer[1])) if peer else ("", 0)
        refused = self._tcp_shares.acquire(source[0])
        if refused is not None:
            self.metrics.count("denied", f"tcp_connection_limit_{refused}", "tcp")
            writer.close()
            return
        try:
            while True:
                try:
                    head = await asyncio.wait_for(
                        reader.readexactly(2), self.settings.tcp_idle_timeout_s
                    )
                    (length,) = struct.unpack("!H", head)
                    data = await asyncio.wait_for(
                        reader.readexactly(length), self.settings.tcp_idle_timeout_s
                    )
                except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                    return
                reply, pending = self.answer_now(data, source, "tcp")
                if pending is not None:
                    reply = await self.answer_later(pending, source, "tcp")
                if reply is None:
                    if length < 12:
                        return  # not DNS at all: drop the connection
                    continue
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except Exception:
            log.exception("dns: tcp connection failed")
        finally:
            self._tcp_shares.release(source[0])
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class _UdpListener:
    """A non-blocking UDP socket read with `loop.add_reader`, draining up to BATCH
    datagrams per wake-up. asyncio's datagram transport reads one datagram per selector
    round, which under load costs more than answering a cached query."""

    BATCH = 64

    def __init__(self, fw: DnsFirewall, host: str, port: int) -> None:
        self.fw = fw
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.sock.setblocking(False)
            self.sock.bind((host, port))
        except BaseException:
            self.sock.close()
            raise
        self.drops = DropReporter(f"{host}:{self.sockname()[1]}", read_drops(self.sock),
                                  time.time())
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.sock.fileno(), self._readable)
        self.closed = False

    def sockname(self) -> tuple[str, int]:
        h, p = self.sock.getsockname()[:2]
        return str(h), int(p)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()

    def _send(self, reply: bytes, addr: Any) -> None:
        if self.closed:
            return
        # a full socket buffer drops the reply: the client retries, as with any UDP loss
        with contextlib.suppress(OSError):
            self.sock.sendto(reply, addr)

    def _readable(self) -> None:
        for _ in range(self.BATCH):
            try:
                data, addr = self.sock.recvfrom(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. an ICMP error queued on the socket: keep serving
                continue
            self._handle(data, addr)

    def _handle(self, data: bytes, addr: Any) -> None:
        source = (str(addr[0]), int(addr[1]))
        try:
            reply, pending = self.fw.answer_now(data, source, "udp")
        except Exception:  # never let one packet take the listener down
            log.exception("dns: udp query failed")
            self.fw.metrics.malformed.inc()
            return
        if pending is not None:
            if len(self.fw._pending) >= self.fw.settings.max_pending:
                reply = self.fw._overloaded(data)
            else:
                self.fw.spawn(self._later(pending, source, addr))
                return
        if reply is not None:
            self._send(reply, addr)

    async def _later(
        self,
        pending: tuple[Query, Task, RuleSet, NeedResolve],
        source: tuple[str, int],
        addr: Any,
    ) -> None:
        try:
            reply = await self.fw.answer_later(pending, source, "udp")
        except Exception:
            log.exception("dns: udp resolution failed")
            return
        if reply is not None:
            self._send(reply, addr)
