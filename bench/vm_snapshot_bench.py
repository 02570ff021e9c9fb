"""MicroVM starts side by side in one run: cold boot vs restore from a snapshot template,
and the exec round trip of a warm session.

Run as root: `.venv/bin/python bench/vm_snapshot_bench.py [--cold N] [--restored N]
[--execs N]`. It builds the guest image from this tree's vm-images/ into its own directory
(the template's stop is in the image's init), starts a launcher on names of its own, and
measures on the host's clock (a restored guest's clock is set from its plan):

- one-shot `true`: `Launcher.run` from call to return (start, command, teardown), cold
  boots first, then the template is saved (timed apart) and the same runs restored;
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

from launcher_rig import started_launcher
from stockade.launcher import Launcher, SandboxSpec, vmimage
from stockade.launcher.backends import backend_for
from stockade.launcher.execspec import ExecSpec
from stockade.policy.model import Limits, Profile

RULES = types.SimpleNamespace(version="bench", profiles={"vm": Profile(
    "vm", "bench microvm", isolation="microvm",
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


def session(launcher: Launcher, execs: int) -> tuple[float, list[float], bool]:
    """(create to ready, exec round trips, restored)."""
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
            p = live.backend.exec(live, ExecSpec(("true",), {"PATH": "/usr/bin:/bin"}),
                                  None)  # type: ignore[arg-type]
            assert p.stdout is not None and p.stdout.read() == b""
            assert p.wait(60) == 0
            trips.append(time.monotonic() - t1)
    finally:
        launcher.kill(live.record.task_id)
        t.join(60)
    return ready, trips, bool(live.pipes.restored)


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
        with started_launcher("vmsnap", "10.213.232.0/22", 7397, microvm={
                "image_dir": str(image), "accel": "tcg"}) as launcher:
            backend = backend_for("microvm")
            state = Path(launcher.config.state_dir) / "launcher"
            cold = one_shot(launcher, args.cold)
            cold_ready, _, was = session(launcher, 0)
            assert not was
            t0 = time.monotonic()
            backend.build_templates(state)  # type: ignore[attr-defined]
            saved = time.monotonic() - t0
            warm = one_shot(launcher, args.restored)
            ready, trips, was = session(launcher, args.execs)
            assert was, "the session was not restored"
    print("| microVM (TCG) | n | p50 | p99 |\n|---|---|---|---|")
    print(row("one-shot `true`, cold boot", cold))
    print(row("one-shot `true`, restored from the template", warm))
    print(row("session create to ready, cold boot", [cold_ready]))
    print(row("session create to ready, restored", [ready]))
    print(row("exec round trip `true` in a warm session", trips))
    print(f"\ntemplate saved once in {saved:.1f} s; restored/cold p50 = "
          f"{statistics.median(warm) / statistics.median(cold):.2f}")


if __name__ == "__main__":
    main()
