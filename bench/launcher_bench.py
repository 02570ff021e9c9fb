"""Launcher benchmark: sandbox start-to-exec, teardown, kill-to-gone, 50 concurrent sandboxes.

Run as root: `.venv/bin/python bench/launcher_bench.py [--runs N] [--concurrent N]`.
Prints one table that puts the launcher next to baselines measured in the same run (a plain
fork/exec of the same command, and `ip netns exec` into a fresh namespace) and the targets.
All traffic stays inside the benchmark's own namespaces; every piece is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

from stockade.launcher import Launcher, SandboxSpec
from stockade.launcher.cgroups import remove_parent
from stockade.policy.model import Limits, Profile

from stockade.config import Config
from stockade.tasks import TaskRegistry, make_control_app, start_control_server

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
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="stockade-bench-"))
    sfx = secrets.token_hex(3)
    cfg = Config.model_validate({
        "state_dir": str(tmp / "state"), "log_dir": str(tmp / "log"), "run_dir": str(tmp / "run"),
        "gateway": {"transparent_listen": ["0.0.0.0:47001"],
                    "control_socket": str(tmp / "gw.sock")},
        "dns": {"listen": ["0.0.0.0:47053"]},
        "broker": {"listen": "0.0.0.0:47081", "control_socket": str(tmp / "br.sock")},
        "launcher": {"nft_table": f"stockade_bench{sfx}", "name_prefix": f"b{sfx[:3]}",
                     "cgroup_parent": f"stockade_bench{sfx}", "scratch_dir": str(tmp / "sbx"),
                     "address_pool": "10.213.240.0/22", "nflog_group": 7399},
    })
    rs = types.SimpleNamespace(profiles={"bench": Profile("bench", "bench", limits=Limits(
        memory=128 * 2**20, disk=16 * 2**20, pids=64, ttl=60, cpus=0.5))}, version="bench")

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runners = [asyncio.run_coroutine_threadsafe(start_control_server(
        make_control_app(TaskRegistry()), p), loop).result(10)
        for p in (cfg.gateway.control_socket, cfg.broker.control_socket)]
    launcher = Launcher(cfg)
    results: dict[str, Any] = {}
    try:
        launcher.start()
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
            box: dict[str, Any] = {}
            th = threading.Thread(target=lambda b=box: b.setdefault(
                "r", launcher.run(SandboxSpec("bench", ["sleep", "60"]), rs)))
            th.start()
            while not [x for x in launcher.list() if x["state"] == "running"]:
                time.sleep(0.001)
            time.sleep(0.05)  # let the command start
            tid = launcher.list()[0]["task_id"]
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
    finally:
        launcher.close()
        subprocess.run(["nft", "delete", "table", "inet", cfg.launcher.nft_table], check=False)
        remove_parent(cfg.launcher.cgroup_root, cfg.launcher.cgroup_parent)
        shutil.rmtree(tmp, ignore_errors=True)
        for r in runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)

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
