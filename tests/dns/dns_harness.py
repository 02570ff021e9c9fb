from __future__ import annotations

import random
from typing import Any

from dns_upstream import Upstream
from prometheus_client import CollectorRegistry
from stockade.gateway.dns.firewall import DnsFirewall
from stockade.gateway.dns.settings import DnsSettings
from stockade.policy.ruleset import RuleSet

from stockade.events import EventWriter, validate
from stockade.net.addresses import AddressPolicy
from stockade.net.resolver import Resolver
from stockade.tasks.registry import Task, TaskRegistry

PROFILE = """\
profile: dns-test
description: names the DNS tests resolve
egress:
  mode: enforce
  allow:
    - host: allowed.test
      reason: the test apex
    - host: "*.allowed.test"
      reason: subdomains of the test apex
      id: allowed-subdomains
  deny:
    - host: denied.allowed.test
      reason: carved out
      id: carve-out
"""

REPORT = """\
profile: dns-report
description: report mode
egress:
  mode: report
  allow:
    - host: allowed.test
      reason: the test apex
"""


def loopback() -> str:
    return f"127.{random.randint(1, 254)}.{random.randint(0, 254)}.{random.randint(2, 254)}"


class Harness:
    """A running DnsFirewall on loopback with one registered task and its event list."""

    def __init__(self, fw: DnsFirewall, client_ip: str, registry: TaskRegistry) -> None:
        self.fw = fw
        self.client_ip = client_ip
        self.registry = registry
        self.events: list[dict[str, Any]] = []
        host, port = fw.addresses[0]
        self.host = host
        self.port = port

    def denials(self, reason: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e["stockade"].get("decision") == "denied"
            and (reason is None or e["event"]["reason"] == reason)
        ]


def _emit_into(events: list[dict[str, Any]]) -> Any:
    def emit(ev: dict[str, Any]) -> None:
        validate(ev)  # every event the firewall produces matches the shared schema
        events.append(ev)

    return emit


async def start_harness(
    upstream: Upstream, ruleset: RuleSet, profile: str = "dns-test",
    writer: EventWriter | None = None, **settings: Any
) -> Harness:
    """With a `writer`, events go through it (throttle, tallies) and `events` holds what
    it wrote."""
    registry = TaskRegistry()
    client_ip = loopback()
    registry.register(Task("task-1", client_ip, profile))
    settings.setdefault("log_allowed", True)  # the tests look at allowed events too
    s = DnsSettings(listen=[f"{loopback()}:0"], **settings)
    resolver = Resolver(
        [upstream.server], AddressPolicy(), ttl_min=s.ttl_min_s, ttl_max=s.ttl_max_s, timeout=0.5
    )
    events: list[dict[str, Any]] = []
    if writer is None:
        fw = DnsFirewall(s, resolver, registry, ruleset, _emit_into(events), CollectorRegistry())
    else:
        writer.subscribe(_emit_into(events))
        fw = DnsFirewall(s, resolver, registry, ruleset, writer.write, CollectorRegistry(),
                         tally=writer.tally)
    await fw.start()
    h = Harness(fw, client_ip, registry)
    h.events = events
    return h
