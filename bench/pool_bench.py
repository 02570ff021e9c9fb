"""Warm pools next to cold starts, in one run (`launcher_bench.py --pools container`).

Per tier: claim-to-first-instruction (from `Launcher.run` being called to the command's
first output timestamp, `echo $EPOCHREALTIME`) from a full pool, the same through
busybox's static shell (no loader, no libraries: nearer the first instruction than bash's
start, which under TCG is most of the row), from a full pool with two inputs (a 64 KiB
file and a tree of 16 files of 4 KiB), and from a cold start;
the refill rate (pooled sandboxes made per second, from empty to the target with
`refill_concurrency` 2); `concurrent` claims at once from a pool of that size (all must
be ready and no two may share a sandbox); the wall time of the short-lived CLI commands
`stockade sandbox kill ID` and `stockade sandbox list` (Python start-up included) against
the benchmark's launcher; and of `stockade run -- true` on embedded defaults with no stack
running (it starts and stops gateway, broker and the dev OpenBao itself).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from launcher_bench import CMD, ms, pct
from launcher_rig import proc_clock, sleeping_sandbox, started_launcher, timed_claim
from stockade.launcher import Launcher, SandboxSpec
from stockade.policy.model import Limits, Profile
from tier_bench import MIB, sandbox_memory

SHAPE = {"cpus": 0.5, "memory_mib": 128, "disk_mib": 16, "pids": 64}
ISOLATION = {"container": "container", "gvisor": "gvisor", "microvm": "microvm"}


def _ruleset(tier: str) -> Any:
    limits = Limits(memory=128 * 2**20, disk=16 * 2**20, pids=64, ttl=60, cpus=0.5)
    return types.SimpleNamespace(profiles={"bench": Profile(
        "bench", "pool bench", isolation=ISOLATION[tier], limits=limits, selftest="sampled")},
        version="bench")  # the stand-in registries answer no probe: sampled, at rate 0


# busybox-static (a bootstrap package): its shell prints the clock with no loader first
STATIC_CMD = ["busybox", "sh", "-c", "echo $EPOCHREALTIME"]
# nearer the first instruction still: no shell to start; the kernel stamps /proc/<pid> when
# the command first looks it up (`launcher_rig.proc_clock`; its coarse clock may read one
# tick early, never late)
FIRST_CMD = ["busybox", "stat", "-L", "-c", "%y", "/proc/self"]


def _first_instruction(launcher: Launcher, rs: Any, runs: int, wait_full: bool,
                       inputs: list[tuple[str, str]] | None = None,
                       cmd: list[str] = CMD) -> list[float]:
    return [timed_claim(launcher, rs, cmd, wait_full=120 if wait_full else 0,
                        inputs=inputs, clock=proc_clock)[0] for _ in range(runs)]


def _inputs(d: Path) -> list[tuple[str, str]]:
    """Two inputs of a claim: a 64 KiB file and a tree of 16 files of 4 KiB."""
    (d / "tree").mkdir()
    (d / "one.bin").write_bytes(secrets.token_bytes(64 * 1024))
    for n in range(16):
        (d / "tree" / f"f{n}").write_bytes(secrets.token_bytes(4096))
    return [(str(d / "one.bin"), "/inputs/one.bin"), (str(d / "tree"), "/inputs/tree")]


def _concurrent(launcher: Launcher, rs: Any, n: int) -> dict[str, Any]:
    assert launcher.pools is not None and launcher.pools.wait_full(600)
    pooled = {r["task_id"] for r in launcher.list() if r["state"] == "pooled"}
    done: list[Any] = []
    barrier = threading.Barrier(n + 1)

    def one() -> None:
        barrier.wait()
        done.append(launcher.run(SandboxSpec("bench", CMD), rs))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for th in threads:
        th.start()
    barrier.wait()
    t0 = time.monotonic()
    for th in threads:
        th.join()
    ids = [r.task_id for r in done]
    return {"n": n, "ok": sum(1 for r in done if r.exit_code == 0),
            "distinct": len(set(ids)), "from_pool": len(set(ids) & pooled),
            "wall": time.monotonic() - t0}


def cli_times(launcher: Launcher, runs: int, python: str = sys.executable,
              env: dict[str, str] | None = None) -> dict[str, list[float]]:
    """`stockade sandbox list` and `sandbox kill ID` of a `sleep 60` sandbox of `launcher`,
    `runs` times, with the interpreter `python` (another checkout's, bench/cli_bench.py)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        # what differs from the defaults only: another checkout's schema may not know
        # a newer key (its models forbid unknown ones)
        yaml.safe_dump(launcher.config.model_dump(mode="json", exclude_defaults=True), fh)
    stockade = [python, "-m", "stockade"]
    kills, lists = [], []
    rs = _ruleset("container")
    try:
        for _ in range(runs):
            th, _box, tid = sleeping_sandbox(launcher, rs)
            t0 = time.monotonic()
            subprocess.run([*stockade, "sandbox", "list", "--config", fh.name], check=True,
                           capture_output=True, env=env)
            lists.append(time.monotonic() - t0)
            t0 = time.monotonic()
            subprocess.run([*stockade, "sandbox", "kill", tid, "--config", fh.name],
                           check=True, capture_output=True, env=env)
            kills.append(time.monotonic() - t0)
            th.join()
    finally:
        Path(fh.name).unlink()
    return {"kill": kills, "list": lists}


BOX = """\
profile: box
description: the embedded stack's wall time (container tier, nothing allowed)
isolation: container
limits: {cpus: 1, memory: 256MiB, disk: 64MiB, pids: 128, ttl: 60s}
egress:
  mode: enforce
exports: {max_file: 1MiB, max_total: 2MiB, types: [text]}
"""


def embedded_run(runs: int, python: str = sys.executable,
                 env: dict[str, str] | None = None,
                 preexec: Callable[[], None] | None = None) -> list[float]:
    """`stockade run --profile box -- true` on embedded defaults with no stack running
    (its own run_dir, base_port and launcher names): the whole command's wall time.
    `preexec` runs in the command's process before it starts (cli_bench.py puts it in a
    cgroup of its own there)."""
    from stockade.instance import PORT_SPAN
    from stockade.ports import free_port_block

    out = []
    with tempfile.TemporaryDirectory(prefix="stockade-embedded-") as d:
        tmp = Path(d)
        for sub in ("profiles", "apis", "presets", "tests"):
            (tmp / "rules" / sub).mkdir(parents=True)
        (tmp / "rules" / "profiles" / "box.yaml").write_text(BOX)
        for _ in range(runs):
            # host-wide names of this run alone: another checkout's bench running at the
            # same time (the machine is shared) removed a table of the same name mid-run
            sfx = secrets.token_hex(3)
            cfg = tmp / "stockade.yaml"
            cfg.write_text(yaml.safe_dump({
                "rules_dir": str(tmp / "rules"), "run_dir": str(tmp / "run"),
                "state_dir": str(tmp / "state"), "log_dir": str(tmp / "log"),
                "base_port": free_port_block(PORT_SPAN),
                "launcher": {"nft_table": f"stockade_emb{sfx}", "name_prefix": f"b{sfx[:3]}",
                             "cgroup_parent": f"stockade_emb{sfx}",
                             "scratch_dir": str(tmp / "sbx"),
                             "address_pool": f"10.212.{secrets.randbelow(250)}.0/24",
                             "nflog_group": 7100 + secrets.randbelow(99)}}))
            t0 = time.monotonic()
            subprocess.run([python, "-m", "stockade", "run", "--profile", "box",
                            "--config", str(cfg), "--", "true"], check=True,
                           capture_output=True, timeout=300, env=env, preexec_fn=preexec)
            out.append(time.monotonic() - t0)
    return out


def run_pools(tiers: list[str], runs: int, concurrent: int) -> None:
    rows: list[tuple[str, list[float], str]] = []
    notes: list[str] = []
    for i, tier in enumerate(tiers):
        pools = {"targets": [{"isolation": tier, "size": concurrent, **SHAPE}],
                 "refill_concurrency": 2}
        rs = _ruleset(tier)
        # as vm_claim_bench: TCG named, not probed (a KVM probe here waits out its timeout)
        vm = {"microvm": {"accel": "tcg"}} if tier == "microvm" else {}
        with started_launcher(f"pool{i}", f"10.213.{224 + 4 * i}.0/22", 7390 + i,
                              keep_pools=True, pools=pools,
                              selftest={"sample_rate": 0.0}, **vm) as launcher:
            t0 = time.monotonic()
            assert launcher.pools is not None and launcher.pools.wait_full(600)
            fill = time.monotonic() - t0
            notes.append(f"{tier}: refill rate {concurrent / fill:.1f} sandboxes/s "
                         f"({concurrent} from empty in {fill:.1f} s, 2 at a time)")
            mem = [sandbox_memory(launcher.s, r["task_id"]) for r in launcher.list()
                   if r["state"] == "pooled"]
            notes.append(f"{tier}: memory per pooled sandbox: PSS "
                         f"{sum(m[0] for m in mem) / len(mem) / MIB:.1f} MiB, cgroup charge "
                         f"{sum(m[1] for m in mem) / len(mem) / MIB:.1f} MiB "
                         f"(mean of {len(mem)})")
            c = _concurrent(launcher, rs, concurrent)
            notes.append(f"{tier}: {c['n']} concurrent claims from a pool of {c['n']}: "
                         f"{c['ok']} ok, {c['distinct']} distinct sandboxes, {c['from_pool']} "
                         f"from the pool, wall {c['wall']:.2f} s")
            rows.append((f"{tier}: claim, pool full", _first_instruction(
                launcher, rs, runs, True), "p50 <= 50, p99 <= 150"))
            rows.append((f"{tier}: claim, static shell, full", _first_instruction(
                launcher, rs, runs, True, cmd=STATIC_CMD), "(same run)"))
            rows.append((f"{tier}: claim, busybox stat (no shell), full", _first_instruction(
                launcher, rs, runs, True, cmd=FIRST_CMD), "(same run)"))
            with tempfile.TemporaryDirectory(prefix="stockade-pool-in-") as d:
                rows.append((f"{tier}: claim + 2 inputs, full", _first_instruction(
                    launcher, rs, runs, True, _inputs(Path(d))), "(same run)"))
        with started_launcher(f"cold{i}", f"10.213.{224 + 4 * i}.0/22", 7390 + i,
                              selftest={"sample_rate": 0.0}, **vm) as cold:
            rows.append((f"{tier}: cold start", _first_instruction(cold, rs, runs, False),
                         "(same run)"))
            if tier == "container":
                cli = cli_times(cold, max(5, runs // 3))
                rows.append(("stockade sandbox kill ID (wall)", cli["kill"], "<= 250"))
                rows.append(("stockade sandbox list (wall)", cli["list"], ""))
    rows.append(("stockade run embedded -- true (wall)", embedded_run(3), "<= 2500"))
    print(f"\nwarm pools vs cold starts ({runs} runs each; milliseconds)\n")
    print(f"{'metric':<36}{'p50':>9}{'p95':>9}{'p99':>9}   target")
    for name, xs, target in rows:
        print(f"{name:<36}{ms(pct(xs, 50))} {ms(pct(xs, 95))} {ms(pct(xs, 99))}   {target}")
    print()
    for n in notes:
        print(n)
