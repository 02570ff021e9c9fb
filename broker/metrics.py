"""Prometheus metrics of one broker, on its own CollectorRegistry (no global state).

Labels carry API names and reason codes only: never a task id (unbounded), never a path
or anything a caller chose freely, never a secret.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


@dataclass(frozen=True, slots=True)
class ApiMetrics:
    """The label children one API's calls touch, looked up once: `labels()` costs a lock
    and a tuple build per call, a noticeable share of the broker's per-call CPU."""

    bytes_up: Any
    bytes_down: Any
    upstream_seconds: Any
    scrubs: Any


class BrokerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter(
            "stockade_broker_calls", "Broker calls by API and outcome (reason code)",
            ["api", "outcome"], registry=r,
        )
        self.upstream_seconds = Histogram(
            "stockade_broker_upstream_seconds", "Upstream call latency (to last byte)",
            ["api"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.vault_seconds = Histogram(
            "stockade_broker_vault_read_seconds", "Vault KV read latency",
            ["result"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.cache = Counter(
            "stockade_broker_secret_cache", "Secret cache lookups (hit, miss, coalesced, stale)",
            ["result"], registry=r,
        )
        self.scrubs = Counter(
            "stockade_broker_scrubs", "Secret echoes removed from upstream responses",
            ["api"], registry=r,
        )
        self.vault_up = Gauge(
            "stockade_broker_vault_up", "1 while Vault answers, 0 after a failed login or read",
            registry=r,
        )
        self.vault_up.set(1)
        self.bytes = Counter(
            "stockade_broker_bytes", "Body bytes through the broker", ["api", "direction"],
            registry=r,
        )
        self.reloads = Counter(
            "stockade_broker_rule_reloads", "Rule reloads by result (success, failure)",
            ["result"], registry=r,
        )
        self.events_dropped = Gauge(
            "stockade_broker_events_dropped", "Events the writer could not write", registry=r
        )

        # label children cached by their label values (bounded: API names and reason
        # codes of the loaded rules, fixed result words)
        self._api: dict[str, ApiMetrics] = {}
        self._calls: dict[tuple[str, str], Any] = {}
        self._cache: dict[str, Any] = {}

    def api(self, name: str) -> ApiMetrics:
        m = self._api.get(name)
        if m is None:
            m = ApiMetrics(self.bytes.labels(name, "up"), self.bytes.labels(name, "down"),
                           self.upstream_seconds.labels(name), self.scrubs.labels(name))
            self._api[name] = m
        return m

    def call(self, api: str, outcome: str) -> None:
        child = self._calls.get((api, outcome))
        if child is None:
            child = self._calls[(api, outcome)] = self.calls.labels(api, outcome)
        child.inc()

    def track_dropped(self, fn: Callable[[], float]) -> None:
        """`stockade_broker_events_dropped` read at scrape time, not set on every call."""
        self.events_dropped.set_function(fn)

    def vault_read(self, seconds: float, ok: bool) -> None:
        self.vault_seconds.labels("ok" if ok else "error").observe(seconds)

    def cache_result(self, what: str) -> None:
        child = self._cache.get(what)
        if child is None:
            child = self._cache[what] = self.cache.labels(what)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
