"""What the fence self-test adds to a start, with and without it in one run.

Run as root: `.venv/bin/python bench/launcher_bench.py --selftest [--runs N]
[--selftest-tier microvm --vm-runs N]` (a microVM's probes run inside its guest). A real
gateway (`stockade gateway serve`: transparent listener and DNS firewall) and a stand-in
broker registry serve one launcher; two profiles differ only in `selftest` (required, and
sampled with launcher.selftest.sample_rate 0), and their starts alternate, so both see
the same machine. The probes' targets are the documentation addresses of the defaults:
a fence that holds redirects or rejects every probe on this host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import yaml
from launcher_rig import bench_config
from stockade.launcher import Launcher, SandboxSpec
from stockade.launcher.cgroups import remove_parent

from stockade.events import read_events
from stockade.ports import free_dual_port, free_port
from stockade.tasks import ControlClient, TaskRegistry, make_control_app, start_control_server

PROFILE = """\
profile: {name}
description: self-test bench
isolation: {tier}
limits: {{cpus: 0.5, memory: 128MiB, disk: 16MiB, pids: 64, ttl: 60s}}
egress: {{mode: enforce}}
selftest: {selftest}
"""
CMD = ["bash", "-c", "echo $EPOCHREALTIME"]


@contextlib.contextmanager
def _stack(tmp: Path, tier: str) -> Iterator[tuple[Launcher, object]]:
    rules = tmp / "rules"
    (rules / "profiles").mkdir(parents=True)
    for name, st in (("with", "required"), ("without", "sampled")):
        (rules / "profiles" / f"{name}.yaml").write_text(
            PROFILE.format(name=name, selftest=st, tier=tier))
    # KVM guests hang on the development VMs: TCG, as the tests
    vm = {"microvm": {"accel": "tcg"}} if tier == "microvm" else {}
    cfg = bench_config(tmp, "stb", "10.213.232.0/22", 7397, selftest={"sample_rate": 0.0}, **vm)
    cfg = cfg.model_validate({
        **cfg.model_dump(mode="json"), "rules_dir": str(rules),
        "gateway": {**cfg.gateway.model_dump(mode="json"),
                    "transparent_listen": [f"0.0.0.0:{free_port('0.0.0.0')}"],
                    "metrics_listen": f"127.0.0.1:{free_port('0.0.0.0')}"},
        "dns": {**cfg.dns.model_dump(mode="json"), "listen": [f"0.0.0.0:{free_dual_port()}"]}})
    path = tmp / "stockade.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    gw = subprocess.Popen([sys.executable, "-m", "stockade", "gateway", "serve", "--config",
                           str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    broker = asyncio.run_coroutine_threadsafe(start_control_server(
        make_control_app(TaskRegistry()), cfg.broker.control_socket), loop).result(10)
    launcher = Launcher(cfg)
    try:
        for _ in range(300):
            with contextlib.suppress(OSError):
                ControlClient(cfg.gateway.control_socket, timeout=1).health()
                break
            time.sleep(0.1)
        launcher.start()
        from stockade.policy import load_rules  # type: ignore[attr-defined]

        yield launcher, load_rules(rules)
    finally:
        launcher.close()
        subprocess.run(["nft", "delete", "table", "inet", cfg.launcher.nft_table],
                       check=False, capture_output=True)
        remove_parent(cfg.launcher.cgroup_root, cfg.launcher.cgroup_parent)
        gw.terminate()
        gw.wait(10)
        asyncio.run_coroutine_threadsafe(broker.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        shutil.rmtree(tmp, ignore_errors=True)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def run_selftest_bench(runs: int, tier: str = "container") -> None:
    tmp = Path(tempfile.mkdtemp(prefix="stockade-stb-"))
    starts: dict[str, list[float]] = {"with": [], "without": []}
    own: list[float] = []
    with _stack(tmp, tier) as (launcher, rules):
        events = launcher.config.events_file
        for i in range(runs + 2):
            for name in ("with", "without"):
                t0 = time.time()
                r = launcher.run(SandboxSpec(name, CMD), rules)
                if i >= 2:  # two warm-up rounds
                    starts[name].append(float(r.stdout) - t0)
        for ev in read_events(events):
            st = ev.get("stockade", {}).get("selftest")
            if ev.get("stockade", {}).get("lifecycle") == "start" and st and "duration_s" in st:
                own.append(st["duration_s"])
    print(f"\nfence self-test, {tier} tier ({runs} starts each, alternating; ms)\n")
    print(f"{'':<32}{'p50':>9}{'p95':>9}")
    for name, xs in (("start-to-exec with self-test", starts["with"]),
                     ("start-to-exec without", starts["without"]),
                     ("the self-test itself", own)):
        print(f"{name:<32}{_pct(xs, 50) * 1000:9.1f}{_pct(xs, 95) * 1000:9.1f}")
    added = _pct(starts["with"], 50) - _pct(starts["without"], 50)
    budget = " (budget 30 ms)" if tier == "container" else ""
    print(f"\nadded at p50: {added * 1000:.1f} ms{budget}")
    print(json.dumps({"with_p50_ms": _pct(starts["with"], 50) * 1000,
                      "without_p50_ms": _pct(starts["without"], 50) * 1000,
                      "selftest_p50_ms": _pct(own, 50) * 1000}))
