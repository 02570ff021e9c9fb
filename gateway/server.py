"""The gateway's asyncio shell: listeners, the connection table, the stages and events.

Only I/O lives here and in `gateway/tcp/`; every decision is made by pure code
(`sniff_tls`, `sniff_http`, `flow.decide_flow`, `AddressPolicy`, `tcp.route`). Two kinds
of listener share one pipeline (`tcp/pipeline.py`):

- transparent: the sandbox's TCP is redirected here by nftables; SO_ORIGINAL_DST gives
  the original destination, used for the port, the log and raw-TCP `cidr` rules only.
- proxy: explicit `HTTPS_PROXY` clients (CONNECT, and absolute-URI plain HTTP).

The gateway always resolves the allowed name itself and dials an address that passed
the special-purpose check; it never dials the client-chosen address for a named flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from stockade.policy.holder import RulesHolder
from stockade.policy.reasons import Reason

from stockade.eager import start_eagerly
from stockade.listen import parse_listen
from stockade.loops import every
from stockade.net.addresses import AddressPolicy
from stockade.net.resolver import Resolver
from stockade.tasks import Task, TaskRegistry

from .conn_events import ConnEvents, Counted, Emit
from .dns.guards import GuardState, NameLimits
from .dns.settings import DnsSettings
from .flow import Listener
from .metrics import GatewayMetrics
from .name_refusals import name_budget_summaries
from .relay import HelloRetryRefused, PipePool, UploadLimit, splice_works
from .settings import GatewaySettings
from .tcp.conn import SHUTDOWN, Conn, ConnTable, unmap_ip
from .tcp.dial import Dialer
from .tcp.listener import BACKLOG, Listening, accept_burst, open_listener
from .tcp.names import NameGate
from .tcp.pipeline import Pipeline, Started, locate_destination

__all__ = ["Gateway", "parse_listen"]  # service.py takes parse_listen from here
log = logging.getLogger("stockade.gateway")


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
        counted: Counted | None = None,
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
        # DNS-tunnelling guards for the names this path resolves; the service passes the
        # DNS firewall's GuardState so a task has one set of name budgets for both paths
        dns_defaults = DnsSettings()
        self.guards = guards or GuardState.from_settings(dns_defaults)
        self.name_limits = name_limits or NameLimits.from_settings(dns_defaults)
        self.pool: PipePool | None = PipePool() if settings.splice and splice_works() else None
        self.table = ConnTable(rules)
        self.conns: set[Conn] = self.table.conns
        # `counted`: the writer's EventWriter.counts, so events only counted are not built
        self.events = ConnEvents(self.metrics, emit, self.tally, counted)
        names = NameGate(self.guards, self.name_limits, resolver)
        dialer = Dialer(settings, address_policy, resolver, names)
        self.pipeline = Pipeline(
            settings, rules, registry, self.table, names, dialer, self.events, self.pool
        )
        self.bound: dict[Listener, list[tuple[str, int]]] = {"transparent": [], "proxy": []}
        self._servers: list[Listening] = []
        self._sweeper: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the one start() runs on
        registry.on_removed(self._task_removed)
        self.metrics.track_registry(lambda: len(self.registry))
        # read when scraped: no gauge update (a lock each) per relayed connection
        self.metrics.track_live(lambda: self.table.relaying)

    @property
    def inspector(self) -> Any:
        """The L7 inspector (InspectorSupervisor), set by the service when inspection is
        on; None: flows that need it stay denied."""
        return self.pipeline.inspector

    @inspector.setter
    def inspector(self, value: Any) -> None:
        self.pipeline.inspector = value

    @property
    def _deferred(self) -> deque[tuple[Callable[..., None], tuple[Any, ...]]]:
        """Events of allowed flows not written yet (see conn_events.EventBatch)."""
        return self.events.batch.pending

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.pipeline.bind(self.loop)
        for kind, addrs in (
            ("transparent", self.settings.transparent_listen),
            ("proxy", self.settings.proxy_listen),
        ):
            for addr in addrs:
                self._listen(kind, addr)  # type: ignore[arg-type]
        self._sweeper = asyncio.ensure_future(self._sweep())

    def _listen(self, kind: Listener, addr: str) -> None:
        sock = open_listener(kind, addr, self.settings)
        self.bound[kind].append(sock.getsockname()[:2])
        listening = Listening(kind, sock, asyncio.get_running_loop())
        # accepting from a reader callback (not a task awaiting sock_accept) saves one
        # event-loop round per connection, and drains a burst of connections at once
        listening.start(lambda: accept_burst(listening, self._spawn))
        self._servers.append(listening)

    def _spawn(self, kind: Listener, client: socket.socket, peer: tuple[Any, ...]) -> None:
        client.setblocking(False)
        conn = self.table.open(kind, client, peer)
        # started here, not queued: its head is read, decided and answered in this
        # callback instead of after the rest of the loop iteration (see stockade.eager)
        conn.handler = start_eagerly(self._handle(conn), self.loop)

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

    def flush_events(self) -> None:
        """Build and write every deferred event now."""
        self.events.batch.flush()

    # -- task lifecycle --------------------------------------------------------------
    def _task_removed(self, task: Task) -> None:
        # the sandbox's connections still in a listen queue are its flows too: accepted
        # now, while the ended task is at hand (the registry has forgotten its address)
        for listening in self._servers:
            accept_burst(listening, functools.partial(self._queued, task), BACKLOG)
        self.table.close_task(task.task_id, Reason.TASK_ENDED)
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
        self.table.close_idle(self.settings.idle_timeout_s)

    async def _poll_rules(self) -> None:
        if await asyncio.to_thread(self.rules.changed):
            self.rules.reload("file_change")

    def _queued(
        self, ended: Task, kind: Listener, client: socket.socket, peer: tuple[Any, ...]
    ) -> None:
        """A connection accepted at `ended`'s end: the ended task's is decided
        `task_ended` at once; another task's is handled as usual, from the loop (not
        inside the registry's removal)."""
        if unmap_ip(peer[0]) != ended.address:
            self._servers[0].loop.call_soon(self._spawn, kind, client, peer)
            return
        conn = self.table.open(kind, client, peer)
        conn.task, conn.close_reason = ended, Reason.TASK_ENDED
        with contextlib.suppress(OSError):  # reset meanwhile: decided without its port
            locate_destination(conn)
        self.events.cut_short(conn, self.rules.current.version)
        self.table.forget(conn)
        with contextlib.suppress(OSError):
            client.close()

    # -- one connection --------------------------------------------------------------
    async def _handle(self, conn: Conn) -> None:
        started: Started | None = None
        try:
            started = await self.pipeline.run(conn)
            if started is not None:
                self.table.relay_started(conn)
                await started.relay.run()
        except asyncio.CancelledError:
            pass  # closed by deregistration, expiry, idle timeout or shutdown
        except UploadLimit:
            conn.close_reason = Reason.UPLOAD_LIMIT
        except HelloRetryRefused as e:  # after a HelloRetryRequest (relay_gate.py)
            assert started is not None
            conn.close_reason = e.refused.reason
            self.events.retry_refused(conn, started.decision, started.dialled, e.refused)
        except OSError:
            pass  # a reset by either side ends the relay; the close event says so
        except Exception:
            # a bug must not take the listener down; the connection closes (fail closed)
            log.exception("connection %s: unexpected error", conn.id)
            conn.close_reason = conn.close_reason or Reason.INTERNAL_ERROR
        finally:
            if started is None:
                self.events.cut_short(conn, self.rules.current.version)
            self.table.forget(conn)
            try:  # noqa: SIM105 - no context object: every connection passes here
                conn.client.close()
            except OSError:
                pass
            if started is not None:
                try:  # noqa: SIM105 - as above
                    started.upstream.close()
                except OSError:
                    pass
                self.events.batch.defer(
                    self.events.closed, conn, started.relay, started.decision,
                    started.dialled, time.time(), time.monotonic(),
                )


def _untallied(_event: dict[str, Any]) -> None:
    return None
