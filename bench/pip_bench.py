#!/usr/bin/env python3
"""`pip download` of 30 packages from the fake internet's index, inspected vs uninspected:
the wall time of a real package client through the gateway with and without the L7
inspector, one run, interleaved rounds.

    .venv/bin/python bench/pip_bench.py [--packages 30] [--runs 5] [--hog]

Wiring (needs root; `inspect_cost_bench.start_rig`, twice, one fake internet): the fake
internet's `pypi.test` serves a PEP 503 index of `--packages` small wheels; two gateways
(each with its inspector child and its own sandbox namespace) differ only in the
profile's `pypi.test` entry:
- uninspected: `host: pypi.test` (spliced after the SNI check);
- inspected: the same with `http: {methods: [GET, HEAD], paths: [/simple/**,
  /packages/**]}` (like the shipped `pypi-readonly` preset's index entry), so every
  index page and every file goes through the inspector.

pip runs inside the namespace with `HTTPS_PROXY` set to that gateway's explicit proxy
(pip resolves no name itself), trusting the fake internet's CA (uninspected) or the
inspection CA, with no cache and no config: `pip download --no-deps` of all packages in
one invocation (one index page and one wheel each, over pip's kept-alive connection).
Columns: wall time of the pip process (median of `--runs`, min-max), its ratio to the
uninspected path (the issue's target: <= 1.3x), and the gateway's CPU (with its
inspector child) per run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import cpuhog
from gateway_bench import cpu_seconds
from gateway_transparent_bench import code_revision
from hostcost import describe as host_cost
from inspect_cost_bench import RULES, host_unavailable, start_rig

from stockade.ports import free_port

INDEX_ENTRY = """\
    - host: pypi.test
      reason: the fake internet's package index{http}
"""
INSPECTED_HTTP = """
      http: {methods: [GET, HEAD], paths: ["/simple/**", "/packages/**"]}"""


@dataclass
class PipPath:
    """One gateway and its namespace: how pip reaches the index."""

    label: str
    ns: object
    proxy: str
    ca: str
    pid: int
    walls: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def pip_env(proxy: str) -> dict[str, str]:
    """A clean pip: no host config or indexes, no cache, no CA-bundle variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PIP_") and k not in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
    }
    env.update(
        HTTPS_PROXY=proxy,
        PIP_NO_CACHE_DIR="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return env


def pip_round(path: PipPath, projects: list[str]) -> None:
    """One `pip download` of every project: wall time and gateway CPU recorded."""
    with tempfile.TemporaryDirectory(prefix="stockade-pip-") as dest:
        argv = [
            sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest,
            "--index-url", "https://pypi.test/simple/", "--cert", path.ca, *projects,
        ]  # fmt: skip
        c0 = cpu_seconds(path.pid)
        t0 = time.perf_counter()
        r = path.ns.run(  # type: ignore[attr-defined]
            argv, env=pip_env(path.proxy), capture_output=True, text=True, timeout=600
        )
        wall = time.perf_counter() - t0
        got = len(list(Path(dest).glob("*.whl")))
        if r.returncode != 0 or got != len(projects):
            raise RuntimeError(
                f"{path.label}: pip failed ({r.returncode}, {got} of {len(projects)} wheels): "
                f"{r.stderr.strip()[-400:]!r}"
            )
    path.walls.append(wall)
    path.cpu.append(cpu_seconds(path.pid) - c0)


def build_paths(stack: contextlib.ExitStack, projects: int) -> list[PipPath]:
    from stockade.testing.testnet import FakeInternet, host

    host.register_cleanup(stack, stack.close)
    stack.callback(host.unregister_cleanup, stack)
    fi = stack.enter_context(FakeInternet(projects=projects))
    paths = []
    for label, http in (("uninspected (spliced)", ""), ("inspected", INSPECTED_HTTP)):
        port = free_port()
        rules = RULES + INDEX_ENTRY.format(http=http)
        _, ns, gw, insp_ca = start_rig(stack, fi=fi, rules=rules, proxy_port=port)
        ca = str(insp_ca) if http else fi.ca_pem
        paths.append(PipPath(label, ns, f"http://{ns.host_ip}:{port}", ca, gw.pid))
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packages", type=int, default=30, help="projects per pip download")
    ap.add_argument("--runs", type=int, default=5, help="interleaved rounds (median shown)")
    ap.add_argument("--hog", action="store_true", help="with a CPU hog on the other core")
    args = ap.parse_args()
    if args.packages < 1 or args.runs < 1:
        ap.error("--packages and --runs must be >= 1")  # exits 2 with the usage
    if host_unavailable():
        return 2

    from stockade.testing.testnet.wheel import demo_wheels

    projects = [w.project for w in demo_wheels(args.packages)]
    load_before = os.getloadavg()
    started = time.monotonic()
    hog = cpuhog.other_core() if args.hog else None
    with contextlib.ExitStack() as stack:
        paths = build_paths(stack, args.packages)
        for path in paths:  # warm-up: first-use costs (pip's imports, the inspector's CA)
            pip_round(path, projects[:1])
            path.walls.clear()
            path.cpu.clear()
        with cpuhog.running(hog):
            for _ in range(args.runs):  # interleaved: drift on a shared host hits both
                for path in paths:
                    pip_round(path, projects)
    print(
        f"stockade pip bench ({code_revision()}): pip download --no-deps of {args.packages} "
        f"packages from pypi.test, median of {args.runs} interleaved rounds, "
        f"{os.cpu_count()} CPUs, {cpuhog.describe(hog)}"
    )
    head = f"{'path':<24}{'wall s':>8}{'min-max':>14}{'vs uninspected':>16}{'gateway CPU s':>15}"
    print(head)
    print("-" * len(head))
    base = statistics.median(paths[0].walls)
    for p in paths:
        wall = statistics.median(p.walls)
        spread = f"{min(p.walls):.2f}-{max(p.walls):.2f}"
        cpu = statistics.median(p.cpu)
        print(f"{p.label:<24}{wall:>8.2f}{spread:>14}{wall / base:>15.2f}x{cpu:>15.3f}")
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\nload average before: {' '.join(f'{x:.2f}' for x in load_before)}, after: "
        f"{load_after}; {time.monotonic() - started:.0f} s; {host_cost()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
