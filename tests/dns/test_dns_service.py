"""The DNS firewall as `stockade gateway serve` runs it: inside GatewayService, sharing
the gateway's Resolver, task registry, rule holder (reloads) and metrics registry."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.message
import dns.rcode
from dns_harness import PROFILE, loopback
from dns_upstream import Upstream
from gw_config import write_config
from polling import async_wait_until

from stockade.config import Config, load_config
from stockade.events import read_events, validate
from stockade.tasks.registry import Task


def _service_config(tmp: Path, upstream: Upstream, *, dns_settings: dict[str, Any] | None = None,
                    events: dict[str, Any] | None = None) -> Config:
    """The dns-test profile and a gateway on loopback before `upstream`, with these
    dns/events settings on top (no events: the defaults, throttle included)."""
    rules = tmp / "rules"
    for d in ("profiles", "apis", "presets", "tests"):
        (rules / d).mkdir(parents=True)
    (rules / "profiles" / "dns-test.yaml").write_text(PROFILE)
    return load_config(write_config(
        tmp, rules, {"listen": [f"{loopback()}:0"], "ttl_min_s": 9, **(dns_settings or {})},
        events=events or None, metrics_listen=f"{loopback()}:0",
        transparent_listen=[f"{loopback()}:0"], proxy_listen=[f"{loopback()}:0"],
        resolvers=[upstream.server],
    ))


@contextlib.asynccontextmanager
async def _running(config: Config, **start: Any) -> AsyncIterator[Any]:
    """`config`'s GatewayService, started (`start`: its keywords) and stopped afterwards."""
    from stockade.gateway.service import GatewayService

    svc = GatewayService(config)
    await svc.start(**start)
    try:
        yield svc
    finally:
        await svc.stop()


def _totals(stored: list[dict[str, Any]]) -> dict[str, Any]:
    """The one event_totals' counts among a task's stored events."""
    (totals,) = [e["stockade"]["totals"] for e in stored
                 if e["event"]["action"] == "event_totals"]
    return totals


async def _ask_as(svc: Any, task_id: str, names: list[str]) -> None:
    """Register `task_id` at a loopback address and ask each name from there (UDP)."""
    assert svc.dns is not None
    host, port = svc.dns.addresses[0]
    client = loopback()
    svc.registry.register(Task(task_id, client, "dns-test"))
    for name in names:
        q = dns.message.make_query(name, "A")
        await dns.asyncquery.udp(q, host, port=port, source=client, timeout=3)


async def test_dns_inside_gateway_service(tmp_path: Path, upstream: Upstream) -> None:
    config = _service_config(tmp_path, upstream)
    rules = Path(config.rules_dir)
    async with _running(config) as svc:
        assert svc.dns is not None
        host, port = svc.dns.addresses[0]
        client = loopback()
        svc.registry.register(Task("svc-task", client, "dns-test"))

        async def ask(name: str) -> dns.message.Message:
            q = dns.message.make_query(name, "A")
            return await dns.asyncquery.udp(q, host, port=port, source=client, timeout=3)

        r = await ask("www.allowed.test")
        assert r.rcode() == dns.rcode.NOERROR
        assert r.answer[0].ttl >= 9  # the dns: section reaches the shared resolver
        # the TCP path's resolver is the same object: the name is already cached there
        assert svc.resolver.cached("www.allowed.test") is not None
        assert (await ask("other.test")).rcode() == dns.rcode.REFUSED
        # a rule reload through the gateway reaches the DNS firewall
        (rules / "profiles" / "dns-test.yaml").write_text(
            PROFILE.replace("  deny:\n", "    - host: other.test\n      reason: now\n  deny:\n")
        )
        await svc.reload()
        assert (await ask("other.test")).rcode() == dns.rcode.NOERROR
        text = svc.metrics.render().decode()
        assert "stockade_dns_queries_total" in text
    events = [e for e in read_events(config.events_file) if e["event"]["action"] == "dns_decision"]
    for e in events:
        validate(e)
    assert any(e["event"].get("reason") == "no_matching_rule" for e in events)


async def test_service_tallies_and_ends_a_task_in_its_store(
        tmp_path: Path, upstream: Upstream) -> None:
    """Wired as `gateway serve` runs it: rate-limited queries are tallied, and when the
    task is deregistered its summaries and totals land in the task's store."""
    from stockade.events.taskstore import read_task_events

    config = _service_config(tmp_path, upstream,
                             dns_settings={"queries_per_second": 0.001, "query_burst": 3})
    async with _running(config) as svc:
        await _ask_as(svc, "svc-flood", ["other.test"] * 60)
        svc.registry.deregister("svc-flood")
    stored = read_task_events(config.task_events_dir, "svc-flood")
    for e in stored:
        validate(e)
    totals = _totals(stored)
    assert totals["written"] + totals["summarised"] == 60
    counted = sum(1 for e in stored if e["event"]["action"] == "dns_decision") + sum(
        e["stockade"]["summary"]["count"] for e in stored
        if e["event"]["action"] == "event_summary")
    assert counted == 60


async def test_name_budget_summaries_come_before_the_tasks_totals(
        tmp_path: Path, upstream: Upstream) -> None:
    """The DNS firewall's end-of-task name-budget summary is written while the writer
    still tracks the task: counted in its totals, and no throttle state left behind."""
    from stockade.events.taskstore import read_task_events

    config = _service_config(tmp_path, upstream, dns_settings={
        "wildcard_names_per_window": 2, "queries_per_second": 1000, "query_burst": 1000})
    async with _running(config) as svc:
        assert svc.dns is not None and svc.writer.throttle is not None
        await _ask_as(svc, "svc-names", [f"n{i}.allowed.test" for i in range(10)])
        svc.registry.deregister("svc-names")
        assert svc.writer.throttle.tracked_tasks == 0
    stored = read_task_events(config.task_events_dir, "svc-names")
    actions = [e["event"]["action"] for e in stored]
    assert actions[-1] == "event_totals" and actions.count("event_totals") == 1
    budget = [e for e in stored if e["event"].get("reason") == "name_budget_exceeded"
              and e["event"]["action"] == "dns_decision"]
    assert any(e["stockade"].get("suppressed_events") for e in budget)  # the end summary
    totals = _totals(stored)
    dns_written = sum(1 for e in stored if e["event"]["action"] == "dns_decision")
    row = [r for r in totals["by"] if r["reason"] == "name_budget_exceeded"]
    assert sum(r["written"] for r in row) == len(budget)
    assert totals["written"] == dns_written


async def test_a_quiet_tasks_summary_is_written_once_its_window_ends(
        tmp_path: Path, upstream: Upstream) -> None:
    """No later event is needed: the service writes ended windows' summaries on its own,
    so a gateway killed afterwards has lost nothing of them."""
    from stockade.events.taskstore import read_task_events

    config = _service_config(tmp_path, upstream,
                             events={"verbatim_per_key": 1, "summary_window_s": 0.2})
    async with _running(config) as svc:
        await _ask_as(svc, "svc-quiet", ["other.test"] * 5)
        summaries = await async_wait_until(  # the test's own patience, not a speed requirement
            lambda: [e for e in read_task_events(config.task_events_dir, "svc-quiet")
                     if e["event"]["action"] == "event_summary"], 10)
        assert sum(e["stockade"]["summary"]["count"] for e in summaries) == 4
        assert svc.registry.get("svc-quiet") is not None  # the task is still running


async def test_tcp_path_budget_refusals_are_in_the_tasks_totals(
        tmp_path: Path, upstream: Upstream) -> None:
    """CONNECT authorities under a wildcard through the gateway's proxy listener, past the
    name budget: the refusals without an event of their own are still counted in the
    task's event totals (the writer's tally), as the DNS path's are."""
    import asyncio

    from stockade.events.taskstore import read_task_events

    config = _service_config(tmp_path, upstream, dns_settings={"wildcard_names_per_window": 2})
    async with _running(config, dns=False) as svc:
        host, port = svc.gateway.bound["proxy"][0][:2]
        client = loopback()
        svc.registry.register(Task("svc-tcp", client, "dns-test"))
        statuses = []
        for i in range(6):  # 2 admitted, 1 refusal logged, 3 only counted
            reader, writer = await asyncio.open_connection(host, port, local_addr=(client, 0))
            writer.write(f"CONNECT n{i}.allowed.test:443 HTTP/1.1\r\n\r\n".encode())
            statuses.append((await reader.readline()).split()[1])
            writer.close()
        assert statuses[2:] == [b"403"] * 4
        svc.registry.deregister("svc-tcp")
    totals = _totals(read_task_events(config.task_events_dir, "svc-tcp"))
    (row,) = [r for r in totals["by"] if r["reason"] == "name_budget_exceeded"]
    # the first refusal and the end summary were written; the other three were counted
    assert (row["written"], row["summarised"]) == (2, 3)
