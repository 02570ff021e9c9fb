"""Pooled microVM claims and session execs of this tree's launcher (TCG, as root).

    .venv/bin/python bench/vm_claim_bench.py [--claims 8] [--execs 30] [--cpus 0.5]
        [--qemu BIN[,BIN...]]

Unlike vm_ab_bench.py (two guests, one host), this times the whole path of whichever
tree's virtualenv runs it, host and guest: run it with each tree's `.venv/bin/python`
(a worktree of the older revision, bootstrapped), alternating, to compare revisions.

- `--claims` claims from a full pool of one to the command's first output, `bash -c 'echo
  $EPOCHREALTIME'` and busybox's static shell (no loader: nearer the first instruction),
  each against the host's clock at `Launcher.run`, and to the run's end; and an extra row
  nearer still (`busybox stat, no shell`): `busybox stat -L -c %y /proc/self`, no shell
  to start and parse (busybox 1.35's `date` has no `%N`): the kernel stamps the command's
  /proc/<pid> inode when it is first looked up, by this command's first system calls
  after busybox's own start (static, no loader). The kernel's coarse clock stamps it (up
  to one tick early: 4 ms at the Debian kernel's HZ=250), so this row can read low, never
  high;
- `--execs` exec round trips of `true`, `busybox true` and `bash -c :`, back to back in one
  warm session (`Backend.exec` in-process, through the agent's port).

The profile's CPU limit is `--cpus` (pool_bench's shape: 0.5). `--qemu` names QEMU
binaries (e.g. one extracted from another Debian package with `dpkg-deb -x`) to run the
same rows with, one launcher each, one after the other in this run. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import types
from typing import Any

import vm_ab_bench
from launcher_bench import pct
from launcher_rig import proc_clock, started_launcher, timed_claim
from pool_bench import FIRST_CMD, SHAPE, STATIC_CMD
from stockade.launcher import Launcher
from stockade.policy.model import Limits, Profile
from vm_ab_bench import load, session, trip

CLAIMS = {"bash": ["bash", "-c", "echo $EPOCHREALTIME"], "static shell": STATIC_CMD,
          "busybox stat, no shell": FIRST_CMD}


EXECS = (("true",), ("busybox", "true"), ("bash", "-c", ":"))


def _rules(cpus: float) -> Any:
    return types.SimpleNamespace(version="bench", profiles={"bench": Profile(
        "bench", "vm claims", isolation="microvm", selftest="sampled", limits=Limits(
            memory=128 * 2**20, disk=16 * 2**20, pids=64, ttl=1800, cpus=cpus))})


def _claims(launcher: Launcher, rules: Any, n: int, rows: dict[str, list[float]]) -> None:
    for _ in range(n):
        for name, cmd in CLAIMS.items():
            first, done = timed_claim(launcher, rules, cmd, clock=proc_clock)
            what = "first instruction" if name.startswith("busybox stat") else "first output"
            rows.setdefault(f"claim, {name}: {what}", []).append(first)
            rows.setdefault(f"claim, {name}: run done", []).append(done)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--claims", type=int, default=8)
    ap.add_argument("--execs", type=int, default=30)
    ap.add_argument("--cpus", type=float, default=0.5)
    ap.add_argument("--qemu", default="qemu-system-x86_64")
    args = ap.parse_args()
    rules = _rules(args.cpus)
    vm_ab_bench.RULES = rules  # its session() claims with these: the same profile here
    pools = {"targets": [{"isolation": "microvm", "size": 1, **dict(SHAPE, cpus=args.cpus)}],
             "refill_concurrency": 1}
    loads = [load()]
    for qemu in args.qemu.split(","):
        rows = _rows(rules, pools, qemu, args)
        loads.append(load())
        print(f"\nmicroVM claims and execs, this tree, cpus {args.cpus}, {_version(qemu)} "
              f"(ms; load {' -> '.join(loads[-2:])})\n")
        for name, xs in rows.items():
            ok = [x * 1000 for x in xs if x == x]  # a failed exec is nan
            print(f"{name:<50} p50 {statistics.median(ok):7.1f}  p90 {pct(ok, 90):7.1f}"
                  f"  p99 {pct(ok, 99):7.1f}"
                  f"  n={len(ok)}", flush=True)


def _rows(rules: Any, pools: dict[str, Any], qemu: str,
          args: argparse.Namespace) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {}
    with started_launcher("vmcb", "10.213.248.0/22", 7395, keep_pools=True, pools=pools,
                          microvm={"accel": "tcg", "qemu": qemu},
                          selftest={"sample_rate": 0.0}) as launcher:
        _claims(launcher, rules, args.claims, rows)
        with session(launcher) as live:
            for _ in range(args.execs):
                for argv in EXECS:
                    rows.setdefault(f"exec {' '.join(argv)}", []).append(trip(live, argv))
    return rows


def _version(qemu: str) -> str:
    out = subprocess.run([qemu, "-version"], capture_output=True, text=True, check=False)
    return out.stdout.split("\n", 1)[0].replace("QEMU emulator version", "QEMU")


if __name__ == "__main__":
    main()
