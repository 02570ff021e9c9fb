"""Prometheus metrics of one gateway instance (own CollectorRegistry, so tests and
several gateways in one process never share counters)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from stockade.netstat import listen_drops

DECISION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 2.5, 10)


class ConnTally:
    """What every connection adds to the metrics (its decision, its bytes, its time to the
    decision), kept as plain numbers and turned into metric families when scraped.

    A prometheus_client counter or histogram takes a lock and several calls per update:
    five per connection, a measurable share of a connection's CPU (bench/README.md). The
    gateway's connections are all counted from its one event-loop thread; a scrape from
    another thread copies each number or dict in one C-level step under the GIL."""

    def __init__(self) -> None:
        self.decisions: dict[tuple[str, str, str], int] = {}
        self.bytes_up = 0
        self.bytes_down = 0
        self.seconds = [0] * (len(DECISION_BUCKETS) + 1)  # per bucket (not cumulative)
        self.seconds_sum = 0.0

    def decided(self, outcome: str, reason: str, profile: str) -> None:
        key = (outcome, reason, profile)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def timed(self, seconds: float) -> None:
        self.seconds[bisect.bisect_left(DECISION_BUCKETS, seconds)] += 1
        self.seconds_sum += seconds

    def relayed(self, up: int, down: int) -> None:
        self.bytes_up += up
        self.bytes_down += down

    def collect(self) -> Iterator[Metric]:
        d = CounterMetricFamily("stockade_gateway_decisions", "Connection decisions",
                                labels=["outcome", "reason", "profile"])
        for key, n in list(self.decisions.items()):
            d.add_metric(list(key), n)
        b = CounterMetricFamily("stockade_gateway_bytes", "Bytes relayed", labels=["direction"])
        b.add_metric(["up"], self.bytes_up)
        b.add_metric(["down"], self.bytes_down)
        counts, total, cumulative = list(self.seconds), self.seconds_sum, 0
        buckets = []
        for le, n in zip((*map(float, DECISION_BUCKETS), float("inf")), counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if le == float("inf") else repr(le), cumulative))
        h = HistogramMetricFamily("stockade_gateway_decision_seconds",
                                  "Accept to decision (sniff, policy, resolve, dial)",
                                  buckets=buckets, sum_value=total)
        return iter((d, b, h))



class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tally = ConnTally()
        r.register(self.tally)
        self.live = Gauge(
            "stockade_gateway_connections_live", "Relayed connections open", registry=r
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
