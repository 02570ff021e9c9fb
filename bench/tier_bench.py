"""The isolation tiers side by side (`bench/launcher_bench.py --tiers ...`): one launcher,
one profile per tier with the same limits, measured in the same run on the same host.

- start-to-exec: the command's own clock (`$EPOCHREALTIME`) minus the time before `run()`
- kill-to-gone: `kill()` until `run()` returned (every process gone, torn down)
- idle memory: `--idle N` sandboxes running `sleep`; the PSS of every process in their
  cgroups (gVisor: Sentry, gofer, stubs; microVM: QEMU; container: init + command) and the
  memory cgroups' charge, each divided by N. gVisor's `runsc run` parent is outside the
  sandbox's cgroups: it is listed apart.
- `--cpu-hook-ab` (with gvisor): gVisor starts interleaved with the CPU quota put in force
  by config.json's prestart hook (as shipped: `gv q@hook`) and when the cgroup is
  made (as before: `gv q@create`), and the sandbox cgroup's throttled periods and
  time (v1 `cpu.stat`) from creation until its command runs (`runsc ps` shows it).
- `runsc bare` (with gvisor): the baseline for the gVisor row, `runsc run` of the same
  command with the launcher's runsc flags in a netns of the bench's, on the host's root
  read-only with one /proc mount and no cgroups (so no CPU quota): runsc's own start here.
  The gVisor row minus this is what the launcher's bundle, cgroups and steps add.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

from launcher_rig import started_launcher
from stockade.launcher import Launcher, SandboxSpec
from stockade.launcher.cgroups import CgroupSet
from stockade.policy.model import Limits, Profile

CMD = ["bash", "-c", "echo $EPOCHREALTIME"]
MIB = 2**20


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def _pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def sandbox_memory(s: Any, task_id: str) -> tuple[int, int]:
    """(PSS of every process in the sandbox's cgroups, its memory cgroup's charge), bytes."""
    cg = CgroupSet(s.cgroup_root, s.cgroup_parent, task_id)
    d = cg.dirs.get("memory") or cg.dirs["unified"]
    f = d / ("memory.usage_in_bytes" if "memory" in cg.dirs else "memory.current")
    return sum(_pss(p) for p in cg.pids()), int(f.read_text())


def _profiles(cpus: float) -> types.SimpleNamespace:
    lim = Limits(memory=128 * MIB, disk=16 * MIB, pids=64, ttl=120, cpus=cpus)
    return types.SimpleNamespace(version="bench", profiles={
        # the stand-in registries answer no probe (launcher_bench.py --selftest measures it)
        t: Profile(t, f"bench {t}", isolation=t, limits=lim, selftest="sampled")
        for t in ("container", "gvisor", "microvm")})


def _start(launcher: Launcher, rs: Any, tier: str, n: int, warm: int = 2) -> list[float]:
    for _ in range(warm):  # warm caches (and the gVisor runtime probe)
        launcher.run(SandboxSpec(tier, CMD), rs)
    out = []
    for _ in range(n):
        t0 = time.time()
        r = launcher.run(SandboxSpec(tier, CMD), rs)
        out.append(float(r.stdout) - t0)
    return out


def _bare_runsc(launcher: Launcher, n: int) -> list[float]:
    from stockade.launcher import gvisor
    from stockade.launcher.backends.gvisor import BACKEND

    rt = BACKEND.runtime(launcher.s)
    ns = f"{launcher.s.name_prefix}-bare"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    out = []
    try:
        with tempfile.TemporaryDirectory(prefix="stockade-bench-runsc-") as d:
            config = gvisor.probe_config()
            config["process"]["args"] = CMD
            Path(d, "config.json").write_text(json.dumps(config))
            runsc, *flags = gvisor.global_flags(shutil.which(launcher.s.gvisor.runsc) or "runsc",
                                                f"{d}/state", rt["platform"], rt["network"])
            for i in range(n + 2):  # the first two warm caches, like _start's
                t0 = time.time()
                p = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "--", runsc,
                                    "--ignore-cgroups", *flags, "run", "--bundle", d, f"bare{i}"],
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                   check=True)
                if i >= 2:
                    out.append(float(p.stdout) - t0)
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)
    return out


def _throttled(launcher: Launcher, rs: Any) -> tuple[int, float]:
    """(throttled periods, throttled ms) of one gVisor sandbox until its command runs."""
    from stockade.launcher.backends.gvisor import BACKEND

    threads, (tid,) = _background(launcher, rs, "gvisor", 1, ["sleep", "600"])
    flags = BACKEND._flags(launcher.s)
    while "sleep" not in subprocess.run([*flags, "ps", tid], capture_output=True,
                                        text=True, check=False).stdout:
        time.sleep(0.02)
    cg = CgroupSet(launcher.s.cgroup_root, launcher.s.cgroup_parent, tid)
    d = cg.dirs.get("cpu") or cg.dirs["unified"]
    stat = dict(line.split() for line in (d / "cpu.stat").read_text().splitlines())
    launcher.kill(tid)
    threads[0].join()
    ms = int(stat["throttled_time"]) / 1e6 if "throttled_time" in stat else \
        int(stat.get("throttled_usec", 0)) / 1e3
    return int(stat["nr_throttled"]), ms


def _cpu_hook_ab(launcher: Launcher, rs: Any, n: int) -> dict[str, dict[str, Any]]:
    from stockade.launcher.backends import gvisor

    shipped = gvisor.GvisorBackend.cpu_at_hook
    modes = {"gv q@hook": shipped, "gv q@create": lambda self, s: False}
    rows: dict[str, dict[str, Any]] = {m: {"start": [], "throttled": []} for m in modes}
    try:
        for i in range(n):
            for m in (list(modes) if i % 2 == 0 else list(modes)[::-1]):
                gvisor.GvisorBackend.cpu_at_hook = modes[m]  # type: ignore[method-assign]
                rows[m]["start"] += _start(launcher, rs, "gvisor", 1, warm=0)
                rows[m]["throttled"].append(_throttled(launcher, rs))
    finally:
        gvisor.GvisorBackend.cpu_at_hook = shipped  # type: ignore[method-assign]
    return rows


def _background(launcher: Launcher, rs: Any, tier: str, n: int,
                argv: list[str] | None = None) -> tuple[list[threading.Thread], list[str]]:
    """`n` sandboxes of `tier` running `sleep` (or `argv`), once each is running."""
    known = {r["task_id"] for r in launcher.list()}
    threads = [threading.Thread(target=launcher.run, args=(
        SandboxSpec(tier, argv or ["sleep", "600"]), rs), daemon=True) for _ in range(n)]
    for th in threads:
        th.start()
    while True:
        ids = [r["task_id"] for r in launcher.list()
               if r["state"] == "running" and r["task_id"] not in known]
        if len(ids) == n:
            return threads, ids
        time.sleep(0.01)


def _kill(launcher: Launcher, rs: Any, tier: str, n: int, settle: float) -> list[float]:
    out = []
    for _ in range(n):
        threads, (tid,) = _background(launcher, rs, tier, 1)
        time.sleep(settle)  # the command is running, not its runtime still starting
        t0 = time.monotonic()
        launcher.kill(tid)
        threads[0].join()
        out.append(time.monotonic() - t0)
    return out


def _idle_memory(launcher: Launcher, rs: Any, tier: str, n: int,
                 settle: float) -> tuple[float, float, float]:
    """(PSS per sandbox, cgroup charge per sandbox, PSS of runsc run per sandbox), MiB."""
    s = launcher.s
    threads, ids = _background(launcher, rs, tier, n)
    time.sleep(settle)
    pss = charge = outside = 0
    for tid in ids:
        p, c = sandbox_memory(s, tid)
        pss, charge = pss + p, charge + c
        live = launcher._live.get(tid)
        if tier == "gvisor" and live is not None and live.proc is not None:
            outside += _pss(live.proc.pid)  # nsenter execs runsc: this is `runsc run`
    for tid in ids:
        launcher.kill(tid)
    for th in threads:
        th.join()
    return pss / n / MIB, charge / n / MIB, outside / n / MIB


def run_tiers(tiers: list[str], runs: int, vm_runs: int, idle: int,
              cpus: float = 0.5, cpu_hook_ab: bool = False) -> None:
    rs = _profiles(cpus)
    rows: dict[str, dict[str, Any]] = {}
    load_before = os.getloadavg()
    # KVM guests hang on these hosts: the microVM tier runs under TCG
    with started_launcher("tiers", "10.213.236.0/22", 7398,
                          microvm={"accel": "tcg"}, selftest={"sample_rate": 0.0}) as launcher:
        for tier in tiers:
            vm = tier == "microvm"
            n = vm_runs if vm else runs
            settle = 3.0 if vm else 0.3
            rows[tier] = {"start": _start(launcher, rs, tier, n),
                          "kill": _kill(launcher, rs, tier, n, settle),
                          "mem": _idle_memory(launcher, rs, tier, min(idle, 3) if vm else idle,
                                              settle * 2)}
            if tier == "gvisor":
                rows["runsc bare"] = {"start": _bare_runsc(launcher, n)}
                if cpu_hook_ab:
                    rows.update(_cpu_hook_ab(launcher, rs, n))
        leftover = sum(len(v) for v in launcher.reconcile().values())
    _report(rows, launcher, load_before, leftover, cpus)


def _report(rows: dict[str, dict[str, Any]], launcher: Launcher,
            load_before: tuple[float, ...], leftover: int, cpus: float) -> None:
    from stockade.launcher.backends.gvisor import BACKEND

    print(f"\nisolation tiers side by side (milliseconds, MiB; {cpus} CPU per sandbox); "
          f"load average before "
          f"{'/'.join(f'{x:.1f}' for x in load_before)}, after "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print(f"{'tier':<11}{'runs':>5}{'start p50':>11}{'p95':>8}{'kill p50':>10}{'p95':>8}"
          f"{'idle PSS':>10}{'cgroup':>8}{'outside':>9}")
    base = rows.get("container", {}).get("start")
    for tier, r in rows.items():
        start = f"{tier:<11}{len(r['start']):>5}{_pct(r['start'], 50) * 1e3:>11.1f}" \
                f"{_pct(r['start'], 95) * 1e3:>8.1f}"
        if "mem" not in r:  # a baseline: start only (and a variant's throttling)
            thr = r.get("throttled")
            print(start + (f"   throttled until exec: p50 {_pct([t[0] for t in thr], 50)} "
                           f"periods, {_pct([t[1] for t in thr], 50):.1f} ms" if thr else ""))
            continue
        pss, charge, outside = r["mem"]
        print(f"{start}{_pct(r['kill'], 50) * 1e3:>10.1f}"
              f"{_pct(r['kill'], 95) * 1e3:>8.1f}{pss:>10.1f}{charge:>8.1f}{outside:>9.1f}")
    if base and "gvisor" in rows:
        ratio = _pct(rows["gvisor"]["start"], 50) / _pct(base, 50)
        print(f"\ngVisor start-to-exec p50 = {ratio:.1f}x the container tier's "
              f"(runtime {BACKEND.runtime(launcher.s)})")
    print(f"leftovers after the run: {leftover}")
