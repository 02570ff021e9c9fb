"""cgroups on this host: v1 limits, freeze and kill for real; the v2 code paths against the
unified hierarchy mounted next to v1 (freeze, kill; creation fails closed without the
memory controller)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from pathlib import Path

import pytest
from polling import eventually
from stockade.launcher.cgroups import (
    V1_CONTROLLERS,
    CgroupSet,
    Limits,
    detect_version,
    v1_shares,
)

pytestmark = pytest.mark.netns

UNIFIED = "/sys/fs/cgroup/unified"


def _remove_v1(cg: CgroupSet, parent: str) -> None:
    """Kill, remove the sandbox's cgroups, then the test's parent in every v1 controller."""
    cg.kill_all()
    cg.remove()
    for c in V1_CONTROLLERS:
        with contextlib.suppress(OSError):
            os.rmdir(f"/sys/fs/cgroup/{c}/{parent}")


def _spawn_into(procs_file: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(["sleep", "60"])
    Path(procs_file).write_text(str(p.pid))
    return p


@pytest.mark.skipif(detect_version("/sys/fs/cgroup") != 1, reason="host is not cgroup v1")
def test_v1_limits_freeze_kill_remove() -> None:
    parent = f"stockade_cgt{secrets.token_hex(3)}"
    cg = CgroupSet("/sys/fs/cgroup", parent, "abcdef0123")
    try:
        cg.create(Limits(memory=48 * 2**20, pids=17, cpus=0.25))
        assert (cg.dirs["memory"] / "memory.limit_in_bytes").read_text().strip() == str(48 * 2**20)
        assert (cg.dirs["pids"] / "pids.max").read_text().strip() == "17"
        assert (cg.dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "25000"
        p = subprocess.Popen(["sleep", "60"])
        for f in cg.procs_files():
            Path(f).write_text(str(p.pid))
        assert cg.pids() == [p.pid]
        cg.freeze(True)
        assert eventually(lambda: (cg.dirs["freezer"] / "freezer.state").read_text().strip()
                          == "FROZEN", interval=0.01)
        cg.freeze(False)
        cg.kill_all()
        p.wait(timeout=10)
        assert p.returncode == -9
        assert cg.pids() == []
        assert cg.oom_kills() == 0 and cg.pids_failures() == 0
    finally:
        _remove_v1(cg, parent)
    assert not cg.exists()


@pytest.mark.skipif(not Path(UNIFIED, "cgroup.controllers").exists(),
                    reason="no unified hierarchy mounted")
def test_v2_paths_on_unified_hierarchy() -> None:
    parent = f"stockade_cgt{secrets.token_hex(3)}"
    cg = CgroupSet(UNIFIED, parent, "abcdef0123")
    assert cg.version == 2
    try:
        controllers = Path(UNIFIED, "cgroup.controllers").read_text().split()
        if "memory" not in controllers:
            # without the memory controller no limit can be enforced: refuse
            with pytest.raises(OSError):
                cg.create(Limits(memory=2**26, pids=16, cpus=1.0))
        d = cg.dirs["unified"]
        d.mkdir(parents=True, exist_ok=True)
        if not (d / "cgroup.kill").exists():
            pytest.skip("kernel without cgroup.kill")
        p = _spawn_into(str(d / "cgroup.procs"))
        assert cg.pids() == [p.pid]
        cg.freeze(True)
        assert eventually(lambda: "frozen 1" in (d / "cgroup.events").read_text(), interval=0.01)
        cg.freeze(False)
        cg.kill_all()
        p.wait(timeout=10)
        assert p.returncode == -9
    finally:
        cg.kill_all()
        cg.remove()
        with contextlib.suppress(OSError):
            os.rmdir(f"{UNIFIED}/{parent}")
    assert not cg.exists()


def test_v1_shares_scale() -> None:
    assert v1_shares(100) == 1024  # both defaults
    assert v1_shares(50) == 512
    assert v1_shares(1) == 10
    assert v1_shares(10000) == 102400


@pytest.mark.skipif(detect_version("/sys/fs/cgroup") != 1, reason="host is not cgroup v1")
def test_v1_parent_gets_the_sandboxes_cpu_weight() -> None:
    parent = f"stockade_cgt{secrets.token_hex(3)}"
    cg = CgroupSet("/sys/fs/cgroup", parent, "abcdef0123", parent_weight=50)
    try:
        cg.create(Limits(memory=48 * 2**20, pids=17, cpus=0.5))
        shares = Path("/sys/fs/cgroup/cpu", parent, "cpu.shares").read_text().strip()
        assert shares == "512"
        # the sandbox's own quota is unchanged by it
        assert (cg.dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
    finally:
        _remove_v1(cg, parent)


@pytest.mark.skipif(detect_version("/sys/fs/cgroup") != 1, reason="host is not cgroup v1")
def test_v1_cpu_quota_later() -> None:
    """cpu_later: the cgroup is made without a CPU quota; cpu_limit names the file and the
    value that put it in force (the gVisor tier's prestart hook writes them)."""
    parent = f"stockade_cgt{secrets.token_hex(3)}"
    cg = CgroupSet("/sys/fs/cgroup", parent, "abcdef0123")
    try:
        cg.create(Limits(memory=48 * 2**20, pids=17, cpus=0.25), cpu_later=True)
        quota = cg.dirs["cpu"] / "cpu.cfs_quota_us"
        assert quota.read_text().strip() == "-1"
        assert (cg.dirs["pids"] / "pids.max").read_text().strip() == "17"
        path, value = cg.cpu_limit(0.25)
        assert (path, value) == (str(quota), "25000")
        Path(path).write_text(value)
        assert quota.read_text().strip() == "25000"
    finally:
        _remove_v1(cg, parent)


def test_v2_cpu_limit_and_cpu_later(tmp_path: Path) -> None:
    """The v2 writes against a tree laid out as the unified hierarchy's (this host has no
    cgroup2 hierarchy with the memory, pids and cpu controllers: they are bound to v1)."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    leaf = tmp_path / "stockade" / "abcdef0123"
    leaf.mkdir(parents=True)
    for f in ("memory.max", "memory.swap.max", "pids.max", "cpu.max"):
        (leaf / f).write_text("")
    cg = CgroupSet(str(tmp_path), "stockade", "abcdef0123")
    assert cg.version == 2
    assert cg.cpu_limit(0.5) == (str(leaf / "cpu.max"), "50000 100000")
    cg.create(Limits(memory=2**26, pids=16, cpus=0.5), cpu_later=True)
    assert (leaf / "cpu.max").read_text() == "max 100000"
    assert (leaf / "memory.max").read_text() == str(2**26)
    assert (leaf / "pids.max").read_text() == "16"
    (leaf / "cpu.max").write_text("")
    cg.create(Limits(memory=2**26, pids=16, cpus=0.5))
    assert (leaf / "cpu.max").read_text() == "50000 100000"
