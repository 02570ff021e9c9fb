"""Warm pools, the pure part: which pool a task can claim from (its tier and resource
shape) and which pooled sandboxes to start next (targets, what is ready, what is being
made, the refill concurrency). No I/O: launcher/pools.py is the shell that acts on it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    from .settings import PoolSettings

MIB = 2**20
# the `isolation:` names of the settings -> the backend that runs the tier
BACKEND_OF = {"container": "netns", "gvisor": "gvisor", "microvm": "microvm"}


@dataclass(frozen=True, slots=True)
class Shape:
    """A pool's key: the backend and the limits every sandbox of it was made with. Its
    fields carry the profile limits' names, so a backend's `create` takes it as limits."""

    backend: str  # netns | gvisor | microvm
    cpus: float
    memory: int  # bytes
    disk: int  # bytes of scratch
    pids: int

    def label(self) -> str:
        """One short name for metrics and `sandbox list`."""
        return (f"{self.backend}/cpus={self.cpus:g},mem={self.memory // MIB}Mi,"
                f"disk={self.disk // MIB}Mi,pids={self.pids}")


def shape_of(backend: str, limits: Any) -> Shape:
    """The shape a profile's limits ask for, run by `backend`."""
    return Shape(backend, float(limits.cpus), int(limits.memory), int(limits.disk),
                 int(limits.pids))


def targets(settings: PoolSettings) -> dict[Shape, int]:
    """Each configured pool's shape and size."""
    return {Shape(BACKEND_OF[t.isolation], float(t.cpus), t.memory_mib * MIB,
                  t.disk_mib * MIB, t.pids): t.size for t in settings.targets}


def next_refills(want: Mapping[Shape, int], ready: Mapping[Shape, int],
                 making: Mapping[Shape, int], concurrency: int) -> list[Shape]:
    """The pooled sandboxes to start now, at most `concurrency` being made at once: one
    per pool in turn, so a big pool does not starve a small one after a burst of claims."""
    free = concurrency - sum(making.values())
    short = {s: n - ready.get(s, 0) - making.get(s, 0) for s, n in want.items()}
    out: list[Shape] = []
    while free > 0 and any(v > 0 for v in short.values()):
        for s in sorted(short, key=Shape.label):  # a stable order: tests and logs agree
            if free > 0 and short[s] > 0:
                out.append(s)
                short[s] -= 1
                free -= 1
    return out


def unknown_tiers(want: Iterable[Shape], pooled_backends: Iterable[str]) -> list[str]:
    """The backends of configured pools that cannot keep pools (their settings refused)."""
    ok = set(pooled_backends)
    return sorted({s.backend for s in want if s.backend not in ok})
