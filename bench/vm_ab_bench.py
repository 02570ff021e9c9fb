"""The microVM guest side of two revisions, interleaved in one run (as root).

    .venv/bin/python bench/vm_ab_bench.py [--base main] [--claims 10] [--execs 40]

What differs between revisions of the guest is in the guest: `vm-images/init` (in the
image), `guest_init.py` and the agent's modules (written onto each guest's config share).
This builds one image from `--base`'s `vm-images/` (`git show`) and one from this tree's,
starts two launchers (TCG, names of their own), each with a microVM pool of one, and
rewrites the base launcher's guest files to the base's sources (keyed by its image
directory, so its pool's background refills get them too). Then, alternating base and
this tree so that both see the same load:

- `--claims` claims from a full pool to the command's first instruction (the guest's
  `echo $EPOCHREALTIME` against the host's clock at `Launcher.run`, as pool_bench.py);
- `--execs` exec round trips of `true` and of `bash -c :` in one warm session each
  (restored from its template; `Backend.exec` in-process, through the agent's port).

The host's code is this tree's for both: only the guest differs. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import marshal
import shutil
import subprocess
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher_bench import CMD, ms, pct
from launcher_rig import started_launcher, timed_claim
from pool_bench import SHAPE
from stockade.launcher import Launcher, SandboxSpec, vmimage
from stockade.launcher.backends import microvm as vm_backend
from stockade.launcher.execspec import ExecSpec
from stockade.policy.model import Limits, Profile

# every module a guest's plan may carry (vm_backend.POOLED_MODULES, the fence's probes)
GUEST_FILES = ("launcher/guest_init.py", "launcher/guest_agent.py", "launcher/vmchannel.py",
               "launcher/guest_inputs.py", "launcher/guest_probes.py", "launcher/guest_pool.py")


def base_sources(rev: str) -> dict[str, str]:
    """module name -> source at `rev` of the guest-side modules (those `rev` has)."""
    out = {}
    for p in GUEST_FILES:
        got = subprocess.run(["git", "show", f"{rev}:{p}"], capture_output=True, text=True)
        if got.returncode == 0:
            out[Path(p).stem] = got.stdout
    return out


def build_image(out: Path, vm_images: Path | None = None) -> Path:
    """The guest image from `vm_images` (a copy of build.sh's directory), or this tree's."""
    script = vmimage.BUILD_SCRIPT if vm_images is None else vm_images / "build.sh"
    subprocess.run(["bash", str(script), str(out)], check=True, capture_output=True)
    return out


def base_vm_images(rev: str, into: Path) -> Path:
    """This tree's vm-images/ with `rev`'s init."""
    shutil.copytree(vmimage.BUILD_SCRIPT.parent, into)
    (into / "init").write_text(subprocess.run(
        ["git", "show", f"{rev}:vm-images/init"], check=True, capture_output=True,
        text=True).stdout)
    return into


@contextlib.contextmanager
def base_guest_files(image_dir: str, sources: dict[str, str]) -> Iterator[None]:
    """The config shares of guests booted from `image_dir` get `sources` (guest_init.py
    and the plan's modules) instead of this tree's."""
    original = vm_backend._write_files

    def write(cfg: Path, ctx: Any, plan: dict[str, Any], *tables: str) -> None:
        original(cfg, ctx, plan, *tables)
        if ctx.settings.microvm.image_dir != image_dir:
            return
        # a module the base does not have yet keeps this tree's source
        plan = dict(plan, modules=[(n, sources.get(n, src)) for n, src in plan.get("modules", [])])
        (cfg / "plan").write_bytes(marshal.dumps(plan, 4))
        (cfg / "guest_init.py").write_text(sources["guest_init"])

    vm_backend._write_files = write  # type: ignore[assignment]
    try:
        yield
    finally:
        vm_backend._write_files = original  # type: ignore[assignment]


# pool_bench's profile (the pool's shape) with a TTL that outlasts the session's execs
RULES = types.SimpleNamespace(version="bench", profiles={"bench": Profile(
    "bench", "vm a/b bench", isolation="microvm", selftest="sampled", limits=Limits(
        memory=128 * 2**20, disk=16 * 2**20, pids=64, ttl=1800, cpus=0.5))})


def claim(launcher: Launcher) -> float:
    return timed_claim(launcher, RULES, CMD)[0]


@contextlib.contextmanager
def session(launcher: Launcher) -> Iterator[Any]:
    """A warm session's Live: claimed from the pool, whose refill is waited for."""
    t = threading.Thread(target=launcher.run, daemon=True,
                         args=(SandboxSpec("bench", ["true"], session=True), RULES))
    t.start()
    while not (new := [r for r in launcher.list() if r["state"] == "running"]):
        time.sleep(0.01)
    live = launcher._live[new[0]["task_id"]]
    assert launcher.pools is not None and launcher.pools.wait_full(300)
    try:
        yield live
    finally:
        launcher.kill(live.record.task_id)
        t.join(60)


def trip(live: Any, argv: tuple[str, ...]) -> float:
    """One exec's round trip; an exec that fails is said and counted (nan)."""
    t0 = time.monotonic()
    p = live.backend.exec(live, ExecSpec(argv, {"PATH": "/usr/bin:/bin"}), None)
    assert p.stdout is not None and p.stderr is not None
    out, err = p.stdout.read(), p.stderr.read()
    rc = p.wait(60)
    if rc != 0:
        print(f"{argv}: exit {rc}, stdout {out[:200]!r}, stderr {err[:400]!r}", flush=True)
        return float("nan")
    return time.monotonic() - t0


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 1)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="main")
    ap.add_argument("--claims", type=int, default=10)
    ap.add_argument("--execs", type=int, default=40)
    args = ap.parse_args()
    sources = base_sources(args.base)
    results: dict[str, dict[str, list[float]]] = {"base": {}, "tree": {}}
    loads = [load()]
    with tempfile.TemporaryDirectory(prefix="stockade-vmab-") as d:
        images = {"base": str(build_image(Path(d) / "vm-base", base_vm_images(
            args.base, Path(d) / "vm-images-base"))), "tree": str(build_image(Path(d) / "vm"))}
        pools = {"targets": [{"isolation": "microvm", "size": 1, **SHAPE}],
                 "refill_concurrency": 1}
        with base_guest_files(images["base"], sources), \
                started_launcher("vmab", "10.213.248.0/22", 7395, keep_pools=True,
                                 pools=pools, microvm={"image_dir": images["base"],
                                                       "accel": "tcg"},
                                 selftest={"sample_rate": 0.0}) as base, \
                started_launcher("vmat", "10.213.252.0/22", 7396, keep_pools=True,
                                 pools=pools, microvm={"image_dir": images["tree"],
                                                       "accel": "tcg"},
                                 selftest={"sample_rate": 0.0}) as tree:
            launchers = {"base": base, "tree": tree}
            for _ in range(args.claims):
                for name, launcher in launchers.items():
                    results[name].setdefault("claim to first instruction", []).append(
                        claim(launcher))
            loads.append(load())
            with session(base) as b, session(tree) as t:
                lives = {"base": b, "tree": t}
                for _ in range(args.execs):
                    for name, live in lives.items():
                        for argv in (("true",), ("bash", "-c", ":")):
                            results[name].setdefault(" ".join(argv), []).append(
                                trip(live, argv))
            loads.append(load())
    print(f"\nmicroVM guest, {args.base} vs this tree, interleaved (ms; load average "
          f"{' -> '.join(loads)})\n")
    print(f"{'metric':<44}{'p50':>9}{'p95':>9}{'p99':>9}")
    for metric in results["tree"]:
        for name in ("base", "tree"):
            failed = [x for x in results[name][metric] if x != x]
            xs = [x for x in results[name][metric] if x == x]
            if failed:
                print(f"{metric} ({name}): {len(failed)} failed")
            label = f"{metric} ({args.base if name == 'base' else 'this tree'}, n={len(xs)})"
            print(f"{label:<44}{ms(pct(xs, 50))} {ms(pct(xs, 95))} {ms(pct(xs, 99))}")


if __name__ == "__main__":
    main()
