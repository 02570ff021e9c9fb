"""Wires one running broker: rules, task registry, Vault client, HTTP, control, metrics.

`BrokerService(config)` is what `stockade broker serve` runs and what `stockade run` /
`stockade up` embed: `await svc.start()` ... `await svc.stop()`. Without a Vault
address it can start a DevOpenBao (`dev_vault=True`) so the demo needs no Vault.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from stockade.events import EventWriter
from stockade.events.writer import SUMMARY_FLUSH_S
from stockade.listen import parse_listen
from stockade.loops import every
from stockade.tasks import TaskRegistry, make_control_app, start_control_server
from stockade.tcp import set_congestion_control

from .configview import BrokerConfig
from .metrics import BrokerMetrics
from .rules_watch import RulesWatch
from .secretvalue import NoVault
from .server import Broker
from .settings import VaultSettings

if TYPE_CHECKING:
    from stockade.testing.devvault import DevOpenBao

    from .vault import VaultClient

log = logging.getLogger("stockade.broker")


class BrokerService:
    def __init__(self, config: BrokerConfig, *, dev_vault: bool = False) -> None:
        self.config = config
        self.dev_vault = dev_vault
        self.devbao: DevOpenBao | None = None
        self.broker: Broker | None = None
        self.vault: VaultClient | NoVault | None = None
        self.events: EventWriter | None = None
        self.registry: TaskRegistry | None = None
        self.metrics = BrokerMetrics()
        self._runners: list[web.BaseRunner] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.listen_address: tuple[str, int] | None = None
        self.metrics_address: tuple[str, int] | None = None

    async def start(self) -> None:
        from stockade.policy import load_rules

        cfg = self.config
        s = cfg.broker
        rules_dir = cfg.rules_dir
        watch = RulesWatch(rules_dir, self.reload)  # baseline first: no change missed
        rules = load_rules(rules_dir)  # RulesError: refuse to start on invalid rules
        self.registry = TaskRegistry(s.state_file or Path(cfg.state_dir) / "broker-tasks.json")
        self.events = cfg.event_writer()
        self.events.label_with(self.registry.labels_of)  # every broker event of a task
        self.vault = self._vault_client()
        # upstream names resolve like the gateway's: configured servers, checked addresses
        from .upstream_dns import checked_resolver

        resolver = checked_resolver(cfg)
        self.broker = Broker(s, rules, self.vault, self.registry, self.events, self.metrics,
                             load_rules=lambda: load_rules(rules_dir),
                             resolver=resolver, address_policy=resolver.policy)
        events = self.events
        self.registry.on_removed(lambda task: events.end_task(task.task_id), last=True)
        # log in only now that the broker exists: a failed start-up login reports through
        # Broker.vault_status (gauge to 0, `vault_status` event) like a failed read does
        await self.vault.ensure_login()
        await self.broker.start()
        await self._start_listeners()
        if s.metrics_listen:
            await self._start_metrics(s.metrics_listen)
        self._tasks.append(asyncio.create_task(self._expire_loop()))
        self._tasks.append(asyncio.create_task(
            every(SUMMARY_FLUSH_S, events.flush_due, "broker: event summaries", log)))
        self._tasks.append(asyncio.create_task(
            every(s.rules_poll_interval_s, watch.poll, "broker: rule file polling", log)))

    def _vault_client(self) -> VaultClient | NoVault:
        """The configured Vault, or a dev OpenBao started here when none is configured."""
        s, vs = self.config.broker, self.config.vault
        token: str | None = None
        if vs.address is None and not self.dev_vault and not self.config.dev_vault.enabled:
            return NoVault()  # the stack left the Vault out: no grant needs one
        # here, not at the top: hvac (with requests) is for a broker that has a Vault
        from .vault import VaultClient

        if vs.address is None:
            if not self.dev_vault:
                raise ValueError("vault.address is not set (or start with a dev OpenBao)")
            # on this (main) thread, not an executor thread: the dev server is tied to the
            # life of the thread that starts it (PDEATHSIG); start-up blocks ~1 s, once
            from stockade.testing.devvault import DevOpenBao

            self.devbao = DevOpenBao().start()
            vs = VaultSettings(address=self.devbao.address, timeout_s=vs.timeout_s)
            token = self.devbao.root_token
        return VaultClient(
            vs,
            cache_ttl_s=s.secret_cache_ttl_s,
            serve_stale_s=s.serve_stale_s,
            token=token,
            on_status=self._vault_status,
            on_read=self.metrics.vault_read,
            on_cache=self.metrics.cache_result,
        )

    async def _start_listeners(self) -> None:
        """The sandbox-facing call listener and the control socket."""
        assert self.broker is not None and self.registry is not None
        s = self.config.broker
        site = await self._serve(self.broker.runner(access_log=None, handle_signals=False),
                                 s.listen)
        self.listen_address = _bound(site)
        for sock in site._server.sockets:  # type: ignore[union-attr]
            set_congestion_control(
                sock, s.sandbox_congestion_control, "broker.sandbox_congestion_control", log
            )
        control = make_control_app(self.registry, reload=self.broker.reload,
                                   status=self.broker.status)
        self._runners.append(await start_control_server(control, s.control_socket))

    async def _start_metrics(self, listen: str) -> None:
        mapp = web.Application()

        async def metrics_handler(_r: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(),
                                content_type="text/plain", charset="utf-8")

        mapp.router.add_get("/metrics", metrics_handler)
        site = await self._serve(web.AppRunner(mapp, access_log=None, handle_signals=False),
                                 listen)
        self.metrics_address = _bound(site)

    async def _serve(self, runner: web.BaseRunner, listen: str) -> web.TCPSite:
        """Set up `runner` (cleaned up by `stop`) and listen on `listen`."""
        await runner.setup()
        self._runners.append(runner)
        host, port = parse_listen(listen)
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        return site

    def _vault_status(self, state: str, cause: str) -> None:
        if self.broker is not None:
            self.broker.vault_status(state, cause)

    async def _expire_loop(self) -> None:
        assert self.registry is not None
        # an expiry that cannot be saved (full state disk) is logged and tried again
        await every(0.5, self.registry.expire, "broker: task expiry", log)

    async def reload(self, trigger: str = "control") -> dict[str, Any]:
        assert self.broker is not None
        return await self.broker.reload(trigger)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        for r in reversed(self._runners):
            await r.cleanup()
        self._runners.clear()
        if self.broker is not None:
            await self.broker.close()
        if self.vault is not None:
            await self.vault.close()
        if self.devbao is not None:
            self.devbao.stop()
            self.devbao = None
        if self.events is not None:
            self.events.close()


def _bound(site: web.TCPSite) -> tuple[str, int]:
    server = site._server
    assert server is not None
    sock = server.sockets[0]  # type: ignore[union-attr]
    addr = sock.getsockname()
    return str(addr[0]), int(addr[1])
