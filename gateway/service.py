"""`stockade gateway serve`: wires one process from the config file.

One event writer, one task registry (persisted in the state dir), one rules holder, one
Resolver and one AddressPolicy are shared by the TCP listeners (`server.Gateway`) and the
DNS firewall (`gateway.dns.DnsFirewall`); plus the control API (Unix socket, 0600) and
Prometheus metrics on a host-only address.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import subprocess
from pathlib import Path
from typing import Any

from aiohttp import web
from stockade.policy.holder import RulesHolder

from stockade.events.writer import SUMMARY_FLUSH_S
from stockade.loops import every
from stockade.net.addresses import AddressPolicy
from stockade.net.resolver import Resolver
from stockade.tasks import TaskRegistry, make_control_app, start_control_server

from .configview import GatewayConfig
from .dns.guards import GuardState, NameLimits
from .inspector import InspectorSupervisor
from .metrics import GatewayMetrics
from .server import Gateway, parse_listen

log = logging.getLogger("stockade.gateway")


def host_addresses() -> list[str]:
    """Every non-loopback address on this host's interfaces (the gateway's own addresses)."""
    try:
        out = subprocess.run(
            ["ip", "-j", "addr", "show"], capture_output=True, text=True, check=True, timeout=5
        ).stdout
        links = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    addrs: list[str] = []
    for link in links:
        for a in link.get("addr_info", []):
            local = a.get("local")
            if local and a.get("scope") != "host":
                addrs.append(local)
    return addrs


def raise_nofile(target: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (max(target, hard), hard):
        try:
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (want, want) if want > hard else (want, hard)
            )
            return want
        except (ValueError, OSError):
            continue
    return soft


class GatewayService:
    """Everything `gateway serve` runs, startable in-process (tests) or from the CLI."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        gs = config.gateway
        self.writer = config.event_writer()
        self.metrics = GatewayMetrics()
        self.metrics.track_dropped(lambda: self.writer.dropped)
        self.rules = RulesHolder(config.rules_dir, self.writer.write, self.metrics)
        registry_file = gs.registry_file or str(Path(config.state_dir) / "gateway-tasks.json")
        self.registry = TaskRegistry(registry_file)
        # gateway and DNS events of a task carry its labels (this writer is both's)
        self.writer.label_with(self.registry.labels_of)
        own = list(gs.own_addresses)
        if gs.detect_own_addresses:
            own += host_addresses()
        self.address_policy = AddressPolicy(allow=gs.allow_addresses, own=own)
        self.resolver = Resolver(
            gs.resolvers,
            self.address_policy,
            ttl_min=config.dns.ttl_min_s,
            ttl_max=config.dns.ttl_max_s,
        )
        # one per-task tunnelling-guard state for the DNS firewall and the TCP path: names
        # a sandbox makes the gateway resolve through SNI/Host/CONNECT draw from the same
        # unresolvable-name and name budgets as its DNS queries
        dns = config.dns
        self.guards = GuardState.from_settings(dns)
        self.gateway = Gateway(
            gs,
            rules=self.rules,
            registry=self.registry,
            resolver=self.resolver,
            address_policy=self.address_policy,
            emit=self.writer.write,
            metrics=self.metrics,
            guards=self.guards,
            name_limits=NameLimits.from_settings(dns),
            tally=self.writer.tally,
            counted=self.writer.counts,
        )
        # after every other listener (the DNS firewall's is added later, at start): the
        # task's name-budget summaries are written and counted before its totals
        self.registry.on_removed(lambda task: self.writer.end_task(task.task_id), last=True)
        # L7 inspection: a supervised mitmproxy child for flows whose allow entries need
        # method/path (gateway/inspector/requests.py); without it they stay denied, fail closed
        self.inspector: InspectorSupervisor | None = None
        if gs.inspection.enabled:
            self.inspector = InspectorSupervisor(config)
            self.gateway.inspector = self.inspector
            # the child's own throttle writes the task's summaries and totals then
            inspector = self.inspector
            self.registry.on_removed(lambda task: inspector.end_task(task.task_id))
        self.dns: Any = None
        self._control: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.metrics_port: int | None = None
        self._flusher: asyncio.Task[None] | None = None

    async def start(self, *, dns: bool = True) -> None:
        self.rules.load_initial()  # RulesError: refuse to start rather than run without rules
        raise_nofile(self.config.gateway.max_open_files)
        await self.gateway.start()
        if self.inspector is not None:
            await self.inspector.start()  # ready a moment later; until then, fail closed
        if dns:
            await self._start_dns()
        app = make_control_app(self.registry, reload=self.reload, status=self.gateway.status)
        self._control = await start_control_server(app, self.config.gateway.control_socket)
        await self._start_metrics()
        self._flusher = asyncio.create_task(
            every(SUMMARY_FLUSH_S, self.writer.flush_due, "gateway: event summaries", log))

    async def _start_dns(self) -> None:
        try:
            from .dns.firewall import DnsFirewall
        except ImportError:
            log.warning("gateway.dns.DnsFirewall is not available: DNS firewall not started")
            return
        self.dns = DnsFirewall(
            self.config.dns,
            self.resolver,
            self.registry,
            self.rules,
            self.writer.write,
            self.metrics.registry,
            tally=self.writer.tally,
        )
        # share the gateway's guard state (the firewall's own is unused from here; its
        # task-removal hook looks `guards` up at call time, so it forgets in the shared one)
        self.dns.guards = self.guards
        await self.dns.start()

    async def _start_metrics(self) -> None:
        host, port = parse_listen(self.config.gateway.metrics_listen)
        if host in ("0.0.0.0", "::", ""):  # noqa: S104 - detecting it, not binding
            # metrics name tasks and profiles: they belong on a host-only address
            log.warning("metrics_listen %s is a wildcard address; use a host-only one", host)

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(
                body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
            )

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, host, port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.metrics_port = sockets[0].getsockname()[1] if sockets else port

    async def reload(self) -> dict[str, Any]:
        return self.rules.reload("control_api")

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        await self.gateway.stop()
        if self.inspector is not None:
            await self.inspector.stop()
        if self.dns is not None:
            with contextlib.suppress(Exception):
                await self.dns.stop()
        for runner in (self._control, self._metrics_runner):
            if runner is not None:
                await runner.cleanup()
        self.writer.close()


async def serve(config: GatewayConfig, *, dns: bool = True) -> int:
    """`stockade gateway serve`: run until SIGTERM/SIGINT; SIGHUP reloads the rules. Invalid
    rules, or a listener or directory that cannot be used, at start: exit 2 (see
    stockade.serving)."""
    from stockade.policy import RulesError

    from stockade.serving import serve_until_signalled

    svc: GatewayService | None = None
    started = False

    async def start() -> None:
        nonlocal svc, started
        # built here, not before: its directories (events, state) are start-up errors too
        svc = GatewayService(config)
        await svc.start(dns=dns)
        started = True

    async def stop() -> None:
        if svc is not None:
            await svc.stop()

    def reload() -> Any:
        # before start-up finished there are no rules to replace yet (start loads them)
        return svc.rules.reload("sighup") if svc is not None and started else None

    def banner() -> str:
        assert svc is not None
        bound = ", ".join(
            f"{kind} {h}:{p}" for kind, addrs in svc.gateway.bound.items() for h, p in addrs
        )
        rules = svc.rules.current.version
        return f"serving {bound}, metrics port {svc.metrics_port}, rules {rules}"

    # a SIGTERM during start-up, or a start that fails half-way, still ends in stop()
    return await serve_until_signalled(
        "gateway", start=start, stop=stop, reload=reload, banner=banner,
        invalid_rules=(RulesError,),
    )
