"""Prometheus metrics of one gateway instance (own CollectorRegistry, so tests and
several gateways in one process never share counters)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stockade.netstat import listen_drops


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "stockade_gateway_decisions",
            "Connection decisions",
            ["outcome", "reason", "profile"],
            registry=r,
        )
        self.live = Gauge(
            "stockade_gateway_connections_live", "Relayed connections open", registry=r
        )
        self.bytes = Counter("stockade_gateway_bytes", "Bytes relayed", ["direction"], registry=r)
        # the two children, looked up once (labels() takes a lock and builds a tuple)
        self.bytes_up = self.bytes.labels("up")
        self.bytes_down = self.bytes.labels("down")
        self.decision_seconds = Histogram(
            "stockade_gateway_decision_seconds",
            "Accept to decision (sniff, policy, resolve, dial)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 2.5, 10),
            registry=r,
        )
        self.registry_size = Gauge(
            "stockade_gateway_registry_tasks", "Registered tasks", registry=r
        )
        self.reloads = Counter(
            "stockade_gateway_rule_reloads", "Rule reloads", ["result"], registry=r
        )
        self.events_dropped = Gauge(
            "stockade_gateway_events_dropped", "Events that could not be written", registry=r
        )

        # connections the kernel dropped at a full accept queue: never seen, never decided
        self.listen_drops = Gauge(
            "stockade_gateway_listen_drops",
            "Handshakes the kernel dropped at a full listen queue (this network namespace)",
            registry=r,
        )
        self.listen_drops.set_function(lambda: float(listen_drops() or 0))

    def track_registry(self, size: Callable[[], int]) -> None:
        self.registry_size.set_function(lambda: float(size()))

    def track_live(self, relaying: Callable[[], int]) -> None:
        self.live.set_function(lambda: float(relaying()))

    def track_dropped(self, dropped: Callable[[], int]) -> None:
        self.events_dropped.set_function(lambda: float(dropped()))

    def render(self) -> bytes:
        return generate_latest(self.registry)
