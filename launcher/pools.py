"""Warm pools: per (tier, resource shape) a target number of sandboxes made ahead of any
task, each handed to exactly one task and destroyed after it (never pooled again).

The launcher makes and destroys the sandboxes (`warm`, `discard`: launcher/core.py); this
module decides when (launcher/poolplan.py), keeps the ready ones, refills in the
background with at most `launcher.pools.refill_concurrency` being made at once, and
counts what happened (Prometheus metrics on its own registry, and `rows()` for the
service's health and `sandbox list`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from . import poolplan
from .poolplan import Shape
from .spec import LauncherError

if TYPE_CHECKING:  # annotations only
    from .backends import Live
    from .settings import PoolSettings

log = logging.getLogger("stockade.launcher.pools")
# after a failed refill that pool waits this long, doubled per failure in a row, up to
# the cap: a host that cannot make sandboxes (full disk, nft gone) is not hammered
BACKOFF_S, BACKOFF_MAX_S = 0.5, 30.0
# a claim's refill starts this much later: a refill's start (for gVisor: runsc's two Go
# processes and their seccomp compilations) on the same cores as the claimed command's
# start made the claim to first instruction 74 ms p50 instead of 43 ms (bench/README.md)
REFILL_AFTER_CLAIM_S = 0.3


class PoolMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ready = Gauge("stockade_launcher_pool_ready", "Pooled sandboxes ready to claim",
                           ["pool"], registry=r)
        self.target = Gauge("stockade_launcher_pool_target", "Configured pool size",
                            ["pool"], registry=r)
        self.claims = Counter("stockade_launcher_pool_claims",
                              "Tasks that got a pooled sandbox", ["pool"], registry=r)
        self.misses = Counter("stockade_launcher_pool_misses",
                              "Tasks of a pooled shape that found the pool empty (cold start)",
                              ["pool"], registry=r)
        self.failures = Counter("stockade_launcher_pool_refill_failures",
                                "Pooled sandboxes that failed to start", ["pool"], registry=r)
        self.refill_seconds = Histogram(
            "stockade_launcher_pool_refill_seconds", "Time to make one pooled sandbox",
            ["pool"], buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)


class PoolManager:
    """`warm(shape)` makes one pooled sandbox (LauncherError/OSError: it failed and left
    nothing); `discard(task_id)` destroys one."""

    def __init__(self, settings: PoolSettings, warm: Callable[[Shape], Live],
                 discard: Callable[[str], object]) -> None:
        self.want = poolplan.targets(settings)
        self.concurrency = settings.refill_concurrency
        self._warm, self._discard = warm, discard
        self._ready: dict[Shape, collections.deque[Live]] = {
            s: collections.deque() for s in self.want}
        self._making: collections.Counter[Shape] = collections.Counter()
        self._failed_in_row: collections.Counter[Shape] = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers: ThreadPoolExecutor | None = None
        self.metrics = PoolMetrics()
        self._claims: collections.Counter[Shape] = collections.Counter()
        self._misses: collections.Counter[Shape] = collections.Counter()
        for s, n in self.want.items():
            self.metrics.target.labels(s.label()).set(n)

    def start(self, pooled_backends: list[str]) -> None:
        """Begin filling; LauncherError when a pool names a tier that keeps none."""
        bad = poolplan.unknown_tiers(self.want, pooled_backends)
        if bad:
            raise LauncherError(f"launcher.pools: the {', '.join(bad)} tier keeps no warm "
                                "pools here (its backend has no pooled start)")
        self._workers = ThreadPoolExecutor(self.concurrency, thread_name_prefix="stk-pool")
        self._schedule()

    def take(self, shape: Shape) -> Live | None:
        """A ready sandbox of `shape`, now no longer the pool's (None: no pool of that shape,
        or it is empty: a miss). Each is handed out once."""
        if shape not in self.want:
            return None
        live = None
        dead: list[Live] = []
        with self._lock:
            q = self._ready[shape]
            while q and live is None:
                cand = q.popleft()
                alive = (cand.proc is not None and cand.proc.poll() is None
                         and not cand.killed.is_set())
                live = cand if alive else None
                if not alive:
                    dead.append(cand)
            self.metrics.ready.labels(shape.label()).set(len(q))
            (self._claims if live is not None else self._misses)[shape] += 1
        (self.metrics.claims if live is not None else self.metrics.misses).labels(
            shape.label()).inc()
        for d in dead:  # its init died while it waited: never handed out
            self._discard(d.record.task_id)
        if live is None:
            self._schedule()
        else:  # after the claimed command's start, not competing with it for the CPU
            timer = threading.Timer(REFILL_AFTER_CLAIM_S, self._schedule)
            timer.daemon = True
            timer.start()
        return live

    def forget(self, task_id: str) -> bool:
        """Take one waiting sandbox out of its pool (an operator's kill); True if it was
        there. The caller destroys it; the pool refills."""
        with self._lock:
            hit = next(((s, live) for s, q in self._ready.items() for live in q
                        if live.record.task_id == task_id), None)
            if hit is not None:
                self._ready[hit[0]].remove(hit[1])
                self.metrics.ready.labels(hit[0].label()).set(len(self._ready[hit[0]]))
        if hit is None:
            return False
        self._schedule()
        return True

    def ready(self) -> dict[Shape, int]:
        with self._lock:
            return {s: len(q) for s, q in self._ready.items()}

    def wait_full(self, timeout: float) -> bool:
        """Until every pool is at its target (tests, benchmarks, `stockade up`'s report)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(self.ready()[s] >= n for s, n in self.want.items()):
                return True
            self._stop.wait(0.02)
        return False

    def rows(self) -> list[dict[str, Any]]:
        """One row per pool: what `sandbox list` and the service's health show."""
        with self._lock:
            return [{"pool": s.label(), "backend": s.backend, "target": n,
                     "ready": len(self._ready[s]), "making": self._making[s],
                     "claims": self._claims[s], "misses": self._misses[s]}
                    for s, n in self.want.items()]

    def close(self) -> None:
        """Stop refilling and destroy every sandbox still waiting (claimed ones are their
        tasks' until they end)."""
        with self._lock:
            self._stop.set()
        if self._workers is not None:
            self._workers.shutdown(wait=True)
        with self._lock:
            left = [live for q in self._ready.values() for live in q]
            for q in self._ready.values():
                q.clear()
        for live in left:
            self._discard(live.record.task_id)

    def _schedule(self) -> None:
        with self._lock:
            if self._stop.is_set() or self._workers is None:
                return
            todo = poolplan.next_refills(self.want, {s: len(q) for s, q in self._ready.items()},
                                         self._making, self.concurrency)
            for s in todo:
                self._making[s] += 1
            workers = self._workers
        for s in todo:
            workers.submit(self._refill, s)

    def _refill(self, shape: Shape) -> None:
        t0 = time.monotonic()
        live: Live | None = None
        try:
            live = self._warm(shape)
        except Exception as e:  # logged and counted; the pool retries after a pause
            log.error("warm pool %s: a sandbox failed to start: %s: %s", shape.label(),
                      type(e).__name__, e)
            self.metrics.failures.labels(shape.label()).inc()
            with self._lock:
                self._failed_in_row[shape] += 1
                n = self._failed_in_row[shape]
            self._stop.wait(min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (n - 1)))
        else:
            self.metrics.refill_seconds.labels(shape.label()).observe(time.monotonic() - t0)
        with self._lock:
            self._making[shape] -= 1
            if live is not None:
                self._failed_in_row[shape] = 0
                if not self._stop.is_set():
                    self._ready[shape].append(live)
                    self.metrics.ready.labels(shape.label()).set(len(self._ready[shape]))
                    live = None
        if live is not None:  # the pool closed while it was being made
            self._discard(live.record.task_id)
        self._schedule()
