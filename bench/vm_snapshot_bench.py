"""MicroVM starts side by side in one run: cold boot vs restore from a snapshot template,
and the exec round trip of a warm session.

Run as root: `.venv/bin/python bench/vm_snapshot_bench.py [--cold N] [--restored N]
[--execs N]`. It builds the guest image from this tree's vm-images/ into its own directory
(the template's stop is in the image's init), starts a launcher on names of its own, and
measures on the host's clock (a restored guest's clock is set from its plan):

- one-shot `true`: `Launcher.run` from call to return (start, command, teardown), cold
  boots first, then the template is saved (timed apart) and the same runs restored;
- the start alone: `Launcher.run` to the first instruction of `busybox stat -L -c %y
  /proc/self` (pool_bench.FIRST_CMD, on the guest's clock, set from the host's), cold and
  restored;
- session create to ready (the guest agent waits), cold and restored;
- exec round trip of `true` in a warm session (restored), p50 and p99.
Every piece is removed at the end.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

from launcher_rig import proc_clock, started_launcher, timed_claim
from pool_bench import FIRST_CMD
from stockade.launcher import Launcher, SandboxSpec, vmimage
from stockade.launcher.backends import backend_for
from stockade.launcher.execspec import ExecSpec
from stockade.policy.model import Limits, Profile

# the stand-in registries answer no fence probe: sampled, at rate 0 (as pool_bench.py)
RULES = types.SimpleNamespace(version="bench", profiles={"vm": Profile(
    "vm", "bench microvm", isolation="microvm", selftest="sampled",
    limits=Limits(memory=128 * 2**20, disk=16 * 2**20, pids=64, ttl=600, cpus=1.0))})


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def one_shot(launcher: Launcher, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        r = launcher.run(SandboxSpec("vm", ["true"]), RULES)
        assert r.exit_code == 0, r.stderr
        out.append(time.monotonic() - t0)
    return out


def first_instructions(launcher: Launcher, n: int) -> list[float]:
    """`Launcher.run` to the command's first instruction (pool_bench.FIRST_CMD's clock):
    the start alone, without the command's end and the teardown both kinds pay alike."""
    return [timed_claim(launcher, RULES, FIRST_CMD, wait_full=0, clock=proc_clock,
                        profile="vm")[0] for _ in range(n)]


# in the guest, as an exec runs: a fork and exec of /usr/bin/true (from the 9p /usr) from a
# shell, and the same through setpriv (what each exec paid before the guest init dropped
# privileges itself), 20 each, on the guest's clock
GUEST_COSTS = ("t=/usr/bin/true; t0=$(date +%s%N); for i in $N; do $t; done; "
               "t1=$(date +%s%N); for i in $N; do setpriv --no-new-privs -- $t; done; "
               "t2=$(date +%s%N); echo $(((t1 - t0) / 20000)) $(((t2 - t1) / 20000))")


def exec_true(live: Any, argv: tuple[str, ...] = ("true",)) -> bytes:
    p = live.backend.exec(live, ExecSpec(argv, {"PATH": "/usr/bin:/bin",
                                                "N": " ".join(["x"] * 20)}),
                          None)  # type: ignore[arg-type]
    assert p.stdout is not None
    out = p.stdout.read()
    assert p.wait(60) == 0
    return out


def session(launcher: Launcher, execs: int) -> tuple[float, list[float], Any]:
    """(create to ready, exec round trips, the session's VmPipes)."""
    known = {r["task_id"] for r in launcher.list()}
    t0 = time.monotonic()
    t = threading.Thread(target=launcher.run, daemon=True,
                         args=(SandboxSpec("vm", ["true"], session=True), RULES))
    t.start()
    while not (new := [r for r in launcher.list() if r["task_id"] not in known
                       and r["state"] == "running"]):
        time.sleep(0.01)
    ready = time.monotonic() - t0
    live = launcher._live[new[0]["task_id"]]
    trips = []
    try:
        for _ in range(execs):
            t1 = time.monotonic()
            assert exec_true(live) == b""
            trips.append(time.monotonic() - t1)
        if execs:
            GUEST.extend(int(x) / 1000 for x in exec_true(
                live, ("sh", "-c", GUEST_COSTS)).split())
    finally:
        launcher.kill(live.record.task_id)
        t.join(60)
    return ready, trips, live.pipes


GUEST: list[float] = []  # ms: a fork+exec of `true` in the guest, the same through setpriv


def row(name: str, xs: list[float]) -> str:
    return (f"| {name} | {len(xs)} | {statistics.median(xs) * 1000:.0f} ms | "
            f"{pct(xs, 99) * 1000:.0f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cold", type=int, default=3)
    ap.add_argument("--restored", type=int, default=5)
    ap.add_argument("--execs", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="stockade-vmsnap-") as d:
        image = Path(d) / "vm"
        subprocess.run(["bash", str(vmimage.BUILD_SCRIPT), str(image)], check=True,
                       capture_output=True)
        # snapshot starts off for the cold rows (a cold boot would build the template in
        # the background, and later "cold" runs would restore)
        with started_launcher("vmsnap", "10.213.232.0/22", 7397, microvm={
                "image_dir": str(image), "accel": "tcg", "snapshots": False},
                selftest={"sample_rate": 0.0}) as launcher:
            backend = backend_for("microvm")
            state = Path(launcher.config.state_dir) / "launcher"
            cold = one_shot(launcher, args.cold)
            cold_first = first_instructions(launcher, args.cold)
            cold_ready, _, vm = session(launcher, 0)
            assert not vm.restored
            t0 = time.monotonic()
            (tpl,) = backend.build_templates(state)  # type: ignore[attr-defined]
            saved = time.monotonic() - t0
            launcher.s = launcher.s.model_copy(update={"microvm": launcher.s.microvm.model_copy(
                update={"snapshots": True})})
            warm = one_shot(launcher, args.restored)
            warm_first = first_instructions(launcher, args.restored)
            ready, trips, vm = session(launcher, args.execs)
            assert vm.restored, "the session was not restored"
            size = tpl.stat().st_size
    print("| microVM (TCG) | n | p50 | p99 |\n|---|---|---|---|")
    print(row("one-shot `true`, cold boot", cold))
    print(row("one-shot `true`, restored from the template", warm))
    print(row("start to the command's first instruction, cold boot", cold_first))
    print(row("start to the command's first instruction, restored", warm_first))
    print(row("session create to ready, cold boot", [cold_ready]))
    print(row("session create to ready, restored", [ready]))
    print(row("exec round trip `true` in a warm session", trips))
    ratio = statistics.median(warm_first) / statistics.median(cold_first)
    print(f"\ntemplate saved once in {saved:.1f} s; {size / 2**20:.0f} MiB state file; QEMU "
          f"loaded it in {vm.restore_s * 1000:.0f} ms (the session's restore); restored/cold "
          f"p50: one-shot {statistics.median(warm) / statistics.median(cold):.2f}, start to "
          f"the first instruction {ratio:.2f}")
    if GUEST:
        print(f"in the guest: fork+exec of /usr/bin/true {GUEST[0]:.1f} ms, through setpriv "
              f"{GUEST[1]:.1f} ms (mean of 20 each)")


if __name__ == "__main__":
    main()
