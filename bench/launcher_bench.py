"""Launcher benchmark: sandbox start-to-exec, teardown, kill-to-gone, 50 concurrent sandboxes.

Run as root: `.venv/bin/python bench/launcher_bench.py [--runs N] [--concurrent N]`.
Prints one table that puts the launcher next to baselines measured in the same run (a plain
fork/exec of the same command, and `ip netns exec` into a fresh namespace) and the targets.
`--tiers container,gvisor,microvm` instead puts the isolation tiers side by side in one
run: start-to-exec, kill-to-gone and the memory of an idle sandbox (PSS of every process in
its cgroups, and the memory cgroup's charge, over `--idle N` concurrent sandboxes).
`--pools container` puts warm pools next to cold starts in one run (bench/pool_bench.py):
claim-to-first-instruction, the refill rate, `--concurrent N` claims from a pool of N, and
the wall time of `stockade sandbox kill ID` and `stockade sandbox list`.
All traffic stays inside the benchmark's own namespaces; every piece is removed at the end.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import subprocess
import threading
import time
import types
from typing import Any

from launcher_rig import sleeping_sandbox, started_launcher
from stockade.launcher import SandboxSpec
from stockade.policy.model import Limits, Profile

CMD = ["bash", "-c", "echo $EPOCHREALTIME"]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def ms(x: float) -> str:
    return f"{x * 1000:8.1f}"


def baseline_exec(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.time()
        r = subprocess.run(CMD, capture_output=True, text=True, check=True)
        out.append(float(r.stdout) - t0)
    return out


def baseline_netns(n: int) -> list[float]:
    out = []
    for _ in range(n):
        name = f"stkbench-{secrets.token_hex(3)}"
        t0 = time.time()
        subprocess.run(["ip", "netns", "add", name], check=True)
        try:
            r = subprocess.run(["ip", "netns", "exec", name, *CMD], capture_output=True,
                               text=True, check=True)
            out.append(float(r.stdout) - t0)
        finally:
            subprocess.run(["ip", "netns", "del", name], check=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--concurrent", type=int, default=50)
    ap.add_argument("--tiers", help="e.g. container,gvisor,microvm: the tiers side by side")
    ap.add_argument("--idle", type=int, default=10, help="concurrent idle sandboxes per tier")
    ap.add_argument("--vm-runs", type=int, default=5, help="runs of the microvm tier (TCG)")
    ap.add_argument("--cpus", type=float, default=0.5,
                    help="the tier profiles' CPU limit (gVisor's start is CPU-bound)")
    ap.add_argument("--pools", help="e.g. container: warm pools of these tiers vs cold starts")
    ap.add_argument("--selftest", action="store_true",
                    help="starts with and without the fence self-test, against a real gateway")
    ap.add_argument("--selftest-tier", default="container", choices=("container", "microvm"),
                    help="with --selftest: the tier (microvm: --vm-runs starts each)")
    ap.add_argument("--cpu-hook-ab", action="store_true",
                    help="with gvisor: starts with the CPU quota at the prestart hook and "
                    "at cgroup creation, interleaved")
    args = ap.parse_args()
    if args.pools:
        from pool_bench import run_pools

        run_pools(args.pools.split(","), args.runs, args.concurrent)
        return
    if args.selftest:
        from selftest_bench import run_selftest_bench

        vm = args.selftest_tier == "microvm"
        run_selftest_bench(args.vm_runs if vm else args.runs, args.selftest_tier)
        return
    if args.tiers:
        from tier_bench import run_tiers

        run_tiers(args.tiers.split(","), args.runs, args.vm_runs, args.idle, args.cpus,
                  args.cpu_hook_ab)
        return

    # the stand-in registries answer no probe: the self-test is measured by --selftest
    rs = types.SimpleNamespace(profiles={"bench": Profile("bench", "bench", limits=Limits(
        memory=128 * 2**20, disk=16 * 2**20, pids=64, ttl=60, cpus=0.5), selftest="sampled")},
        version="bench")
    results: dict[str, Any] = {}
    with started_launcher("bench", "10.213.240.0/22", 7399,
                          selftest={"sample_rate": 0.0}) as launcher:
        for _ in range(3):  # warm caches
            launcher.run(SandboxSpec("bench", CMD), rs)
        starts, teardowns, setups = [], [], []
        for _ in range(args.runs):
            t0 = time.time()
            r = launcher.run(SandboxSpec("bench", CMD), rs)
            starts.append(float(r.stdout) - t0)
            teardowns.append(r.timings["teardown_s"])
            setups.append(r.timings["setup_s"])
        results["start"] = starts
        results["teardown"] = teardowns
        results["setup"] = setups

        gone = []
        for _ in range(args.runs):
            th, box, tid = sleeping_sandbox(launcher, rs)
            time.sleep(0.05)  # let the command start
            t0 = time.monotonic()
            launcher.kill(tid)
            th.join()
            gone.append(time.monotonic() - t0)
            assert box["r"].ended_by == "killed"
        results["kill"] = gone

        n = args.concurrent
        peak = 0
        done: list[Any] = []
        barrier = threading.Barrier(n + 1)

        def one() -> None:
            barrier.wait()
            done.append(launcher.run(SandboxSpec("bench", ["sleep", "3"]), rs))

        threads = [threading.Thread(target=one) for _ in range(n)]
        for th in threads:
            th.start()
        t0 = time.monotonic()
        barrier.wait()
        while any(th.is_alive() for th in threads):
            peak = max(peak, sum(1 for x in launcher.list() if x["state"] == "running"))
            time.sleep(0.05)
        wall = time.monotonic() - t0
        ok = sum(1 for r in done if r.exit_code == 0 and r.ended_by == "exit")
        results["concurrent"] = (n, peak, ok, wall)
        leftover = launcher.reconcile()
        results["leftover"] = sum(len(v) for v in leftover.values())

    base_exec = baseline_exec(args.runs)
    base_ns = baseline_netns(args.runs)
    print(f"\nlauncher benchmark ({args.runs} runs each; milliseconds)\n")
    print(f"{'metric':<34}{'p50':>9}{'p95':>9}{'p99':>9}   target")
    rows = [
        ("start-to-exec: stockade sandbox", results["start"], "p50 <= 150 ms"),
        ("  of which host-side setup", results["setup"], ""),
        ("start-to-exec: plain fork/exec", base_exec, "(baseline)"),
        ("start-to-exec: ip netns add+exec", base_ns, "(baseline)"),
        ("teardown (after command exit)", results["teardown"], "<= 200 ms"),
        ("kill-to-gone (kill() returns)", results["kill"], "p99 <= 1 s"),
    ]
    for name, xs, target in rows:
        print(f"{name:<34}{ms(pct(xs, 50))} {ms(pct(xs, 95))} {ms(pct(xs, 99))}   {target}")
    n, peak, ok, wall = results["concurrent"]
    print(f"\n{n} concurrent sandboxes (sleep 3): peak running {peak}, completed ok {ok}/{n}, "
          f"wall {wall:.1f} s (target: all {n})")
    print(f"leftovers after the run: {results['leftover']}")
    print(f"mean start-to-exec {statistics.mean(results['start']) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
