"""Per-sandbox cgroups: v2 when the unified hierarchy is mounted at the root, else v1
(memory, pids, cpu, freezer under `<root>/<controller>/<parent>/<id>`, as on hosts that
only have v1). Plain file writes: no library covers both versions with freeze and kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
CPU_PERIOD_US = 100_000


def cpu_quota(cpus: float) -> int:
    """The CFS quota (us per CPU_PERIOD_US) of `cpus` CPUs."""
    return int(cpus * CPU_PERIOD_US)


def cpu_max(cpus: float) -> str:
    """cgroup v2 `cpu.max` of `cpus` CPUs (a microVM's guest writes it for its command)."""
    return f"{cpu_quota(cpus)} {CPU_PERIOD_US}"


def v1_shares(weight: int) -> int:
    """cgroup v2 `cpu.weight` (1-10000, default 100) as v1 `cpu.shares` (default 1024)."""
    return max(2, weight * 1024 // 100)


def detect_version(root: str) -> int:
    return 2 if Path(root, "cgroup.controllers").exists() else 1


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


@dataclass(frozen=True, slots=True)
class Limits:
    memory: int
    pids: int
    cpus: float


class CgroupSet:
    """One sandbox's cgroup(s). Every method tolerates a half-created or gone cgroup."""

    def __init__(
        self, root: str, parent: str, name: str, parent_weight: int | None = None
    ) -> None:
        self.version = detect_version(root)
        # CPU weight of the parent (all sandboxes together) against its siblings such as
        # system.slice: under contention the gateway and broker run first
        self.parent_weight = parent_weight
        self.root = Path(root)
        self.parent = parent
        self.name = name
        if self.version == 2:
            self.dirs = {c: self.root / parent / name for c in ("unified",)}
        else:
            self.dirs = {c: self.root / c / parent / name for c in V1_CONTROLLERS}

    @property
    def paths(self) -> list[str]:
        return [str(p) for p in self.dirs.values()]

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def cpu_limit(self, cpus: float) -> tuple[str, str]:
        """The file and the value that put a CPU limit of `cpus` in force: for a writer that
        is not this process (the gVisor tier's OCI prestart hook)."""
        if self.version == 2:
            return str(self.dirs["unified"] / "cpu.max"), cpu_max(cpus)
        return str(self.dirs["cpu"] / "cpu.cfs_quota_us"), str(cpu_quota(cpus))

    def create(self, limits: Limits, cpu_later: bool = False) -> None:
        """Make the cgroup(s) with the limits in force; `cpu_later`: no CPU quota yet (the
        caller puts `cpu_limit`'s value in force before anything of the sandbox's runs)."""
        if self.version == 2:
            parent = self.root / self.parent
            parent.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):  # may already be enabled
                _write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
            d = self.dirs["unified"]
            d.mkdir(exist_ok=True)
            _write(d / "memory.max", str(limits.memory))
            with contextlib.suppress(FileNotFoundError):
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(limits.pids))
            _write(d / "cpu.max", f"max {CPU_PERIOD_US}" if cpu_later
                   else self.cpu_limit(limits.cpus)[1])
            self._weigh_parent(parent / "cpu.weight", str(self.parent_weight))
            return
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        m = self.dirs["memory"]
        _write(m / "memory.limit_in_bytes", str(limits.memory))
        with contextlib.suppress(OSError):  # absent without swap accounting
            _write(m / "memory.memsw.limit_in_bytes", str(limits.memory))
        _write(self.dirs["pids"] / "pids.max", str(limits.pids))
        c = self.dirs["cpu"]
        _write(c / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(c / "cpu.cfs_quota_us", "-1" if cpu_later else self.cpu_limit(limits.cpus)[1])
        if self.parent_weight is not None:
            self._weigh_parent(c.parent / "cpu.shares", str(v1_shares(self.parent_weight)))

    def _weigh_parent(self, path: Path, value: str) -> None:
        if self.parent_weight is None:
            return
        # best effort: the weight protects the services, the sandbox's own limits stand
        with contextlib.suppress(OSError):
            _write(path, value)

    def pids(self) -> list[int]:
        d = self.dirs["unified" if self.version == 2 else "pids"]
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def pids_current(self) -> int:
        """Tasks (threads included) in the pids cgroup now."""
        d = self.dirs["unified" if self.version == 2 else "pids"]
        try:
            return int((d / "pids.current").read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        if self.version == 2:
            return _read_kv(self.dirs["unified"] / "memory.events").get("oom_kill", 0)
        return _read_kv(self.dirs["memory"] / "memory.oom_control").get("oom_kill", 0)

    def pids_failures(self) -> int:
        d = self.dirs["unified" if self.version == 2 else "pids"]
        return _read_kv(d / "pids.events").get("max", 0)

    def freeze(self, frozen: bool) -> None:
        if self.version == 2:
            _write(self.dirs["unified"] / "cgroup.freeze", "1" if frozen else "0")
        else:
            _write(self.dirs["freezer"] / "freezer.state", "FROZEN" if frozen else "THAWED")

    def kill_all(self) -> None:
        """SIGKILL every process; frozen first (v1) so a fork bomb cannot outrun the loop."""
        if self.version == 2:
            try:
                _write(self.dirs["unified"] / "cgroup.kill", "1")
                return
            except OSError:
                pass
        for _ in range(100):
            pids = self.pids()
            if not pids:
                return
            with contextlib.suppress(OSError):
                self.freeze(True)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                self.freeze(False)  # killed tasks only die once thawed
            time.sleep(0.005)

    def remove(self) -> None:
        """rmdir every directory; retries briefly while dying tasks leave."""
        for d in self.dirs.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    self.kill_all()
                    time.sleep(0.005)

    def exists(self) -> bool:
        return any(d.exists() for d in self.dirs.values())


def leftover_names(root: str, parent: str) -> set[str]:
    """Names of sandbox cgroups under `parent` (for reconcile)."""
    names: set[str] = set()
    bases = ([Path(root, parent)] if detect_version(root) == 2
             else [Path(root, c, parent) for c in V1_CONTROLLERS])
    for base in bases:
        with contextlib.suppress(OSError):
            names.update(p.name for p in base.iterdir() if p.is_dir())
    return names


def remove_parent(root: str, parent: str) -> None:
    """rmdir the (empty) parent cgroups; for test and bench runs with their own parent."""
    bases = ([Path(root, parent)] if detect_version(root) == 2
             else [Path(root, c, parent) for c in V1_CONTROLLERS])
    for base in bases:
        with contextlib.suppress(OSError):
            base.rmdir()
