#!/usr/bin/env python3
"""Inspection cost benchmark: bulk download throughput through an inspected entry
(`host_must_match_sni: true`, so every request goes through the L7 inspector) and an
uninspected one (spliced after the SNI check), in one run with interleaved rounds.

    .venv/bin/python bench/inspect_cost_bench.py [--bytes 256MiB] [--runs 3] [--http2]

Wiring (needs root; everything is removed again at exit):
- the fake internet (`stockade.testing.testnet.FakeInternet`): its HTTPS sites serve
  `/bytes/<n>` (aiohttp, 64 KiB writes) with certificates from its own CA;
- `stockade gateway serve` (gateway_bench's `spawn_gateway`) with its inspector child,
  trusting the fake internet's CA upstream; one profile allows `allowed.test`
  uninspected and `other.test` with `host_must_match_sni: true`;
- a `stockade.testing.testnet.ClientNamespace` whose TCP is redirected to the gateway's
  transparent listener (a sandbox as the launcher wires it), registered as a task;
- curl in the namespace downloads `--bytes` from each name in turn: the spliced path
  trusting the fake internet's CA (the upstream's own certificate), the inspected one
  trusting the gateway's inspection CA (the inspector's leaf certificate).

Columns: MiB/s (median of `--runs`, with min-max), the ratio to the spliced path, and
the gateway's CPU seconds per GiB (gateway and inspector processes, from the scheduler's
run time): what Host = SNI costs per byte on this host.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from gateway_bench import cpu_seconds, parse_size, spawn_gateway
from gateway_transparent_bench import code_revision, stop_proc, wait_listen
from hostcost import describe as host_cost

from stockade.ports import free_port

SPLICED, INSPECTED = "allowed.test", "other.test"
RULES = f"""\
profile: bench
description: inspection cost benchmark
limits: {{egress_bytes: 1000GiB}}
egress:
  allow:
    - host: {SPLICED}
      reason: spliced after the SNI check
    - host: {INSPECTED}
      reason: every request's Host held to the SNI by the inspector
      host_must_match_sni: true
"""


def download(ns, fi, name: str, ca: str, nbytes: int, http2: bool) -> float:  # type: ignore[no-untyped-def]
    """MiB/s of one curl download of `nbytes` from `name` inside the namespace."""
    r = ns.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code} %{size_download} %{time_total}",
         "--http2" if http2 else "--http1.1", "--max-time", "600", "--cacert", ca,
         *fi.resolve_args(name), f"https://{name}/bytes/{nbytes}"],
        capture_output=True, text=True, timeout=660,
    )  # fmt: skip
    parts = r.stdout.split()
    if r.returncode != 0 or len(parts) != 3 or parts[0] != "200" or int(parts[1]) != nbytes:
        raise RuntimeError(f"{name}: curl failed: {r.stdout!r} {r.stderr.strip()!r}")
    return nbytes / float(parts[2]) / 2**20


def wait_inspector(ns, fi, ca: Path, timeout: float = 90) -> None:  # type: ignore[no-untyped-def]
    """Until an inspected request goes through (the inspector child is up)."""
    end = time.monotonic() + timeout
    while True:
        if ca.exists():
            with contextlib.suppress(RuntimeError):
                download(ns, fi, INSPECTED, str(ca), 1, False)
                return
        if time.monotonic() > end:
            raise RuntimeError("the inspector did not become ready")
        time.sleep(0.5)


def host_unavailable() -> bool:
    """True, with the reason on stderr, where this host cannot run the rig (it needs
    root and network namespaces)."""
    from stockade.testing.testnet import host

    reason = host.available()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
    return bool(reason)


def register(ctl, task, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    """Register `task` once the gateway's control socket answers."""
    end = time.monotonic() + timeout
    while True:
        try:
            ctl.register(task)
            return
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def start_rig(  # type: ignore[no-untyped-def]
    stack: contextlib.ExitStack,
    exempt_ports: tuple[int, ...] = (),
    code: Path | None = None,
    fi=None,
    rules: str = RULES,
    proxy_port: int | None = None,
):
    """The fake internet (`fi`, or a new one), a sandbox namespace redirected to a gateway
    (this tree's, or the build in `code`: gateway_bench's --baseline) with its inspector
    (ready), the task registered; all torn down by `stack`. `exempt_ports`: host ports
    the namespace may reach directly (other proxies in a side-by-side run); `rules`: the
    task's profile (it must keep RULES' entries); `proxy_port`: the gateway's explicit
    proxy port on the namespace's host address (default: a free one). Returns
    (fake internet, namespace, gateway process, the inspector CA's path)."""
    from stockade.tasks import ControlClient, Task
    from stockade.testing.testnet import ClientNamespace, FakeInternet, host

    tport, pport = free_port(), proxy_port or free_port()
    if fi is None:
        host.register_cleanup(stack, stack.close)
        stack.callback(host.unregister_cleanup, stack)
        fi = stack.enter_context(FakeInternet())
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stockade-bench-")))
    ns = ClientNamespace(
        name_suffix=f"bench{secrets.token_hex(3)}",
        redirect_tcp_port=tport,
        redirect_dns_port=free_port(),
        exempt_tcp_ports=(pport, *exempt_ports),
    )
    stack.callback(ns.stop)
    ns.start()
    d = tmp / "gw"
    (d / "rules" / "profiles").mkdir(parents=True)
    (d / "rules" / "profiles" / "bench.yaml").write_text(rules)
    gw = spawn_gateway(
        d, f"{ns.host_ip}:{tport}", f"{ns.host_ip}:{pport}", 0,
        resolvers=[fi.dns_server], allow_addresses=[fi.subnet],
        code=code, inspection={"upstream_ca_file": fi.ca_pem},
    )  # fmt: skip
    stack.callback(stop_proc, gw)
    wait_listen(ns.host_ip, tport, gw)
    register(ControlClient(d / "run" / "gw.sock"), Task("bench", ns.address, "bench"))
    insp_ca = d / "state" / "gateway" / "inspector-ca" / "mitmproxy-ca-cert.pem"
    wait_inspector(ns, fi, insp_ca)
    return fi, ns, gw, insp_ca


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="256MiB", help="download size per run")
    ap.add_argument("--runs", type=int, default=3, help="rounds (median is shown)")
    ap.add_argument("--http2", action="store_true", help="curl --http2 (default --http1.1)")
    args = ap.parse_args()

    if host_unavailable():
        return 2
    nbytes = parse_size(args.bytes)
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        fi, ns, gw, insp_ca = start_rig(stack)
        paths = {"spliced": (SPLICED, fi.ca_pem), "inspected": (INSPECTED, str(insp_ca))}
        rates: dict[str, list[float]] = {k: [] for k in paths}
        cpu: dict[str, float] = dict.fromkeys(paths, 0.0)
        for _ in range(args.runs):  # interleaved: drift on a shared host hits both alike
            for key, (name, ca) in paths.items():
                c0 = cpu_seconds(gw.pid)
                rates[key].append(download(ns, fi, name, ca, nbytes, args.http2))
                cpu[key] += cpu_seconds(gw.pid) - c0
    print_table(args, nbytes, rates, cpu, load_before)
    return 0


def print_table(
    args: argparse.Namespace,
    nbytes: int,
    rates: dict[str, list[float]],
    cpu: dict[str, float],
    load_before: tuple[float, float, float],
) -> None:
    proto = "HTTP/2" if args.http2 else "HTTP/1.1"
    print(
        f"stockade inspection cost bench ({code_revision()}): 1 curl download of "
        f"{nbytes / 2**20:.0f} MiB over {proto} per path per round, median of {args.runs} "
        f"interleaved rounds, {os.cpu_count()} CPUs"
    )
    base = statistics.median(rates["spliced"])
    print(f"{'path':<38}{'MiB/s':>8}{'min-max':>14}{'vs spliced':>12}{'gw CPU s/GiB':>14}")
    print("-" * 86)
    labels = {"spliced": f"{SPLICED} (spliced, SNI only)",
              "inspected": f"{INSPECTED} (host_must_match_sni)"}  # fmt: skip
    for key, values in rates.items():
        med = statistics.median(values)
        spread = f"{min(values):.0f}-{max(values):.0f}"
        per_gib = cpu[key] / (nbytes * len(values) / 2**30)
        print(f"{labels[key]:<38}{med:>8.0f}{spread:>14}{med / base:>11.0%} {per_gib:>13.2f}")
    print(
        textwrap.dedent(f"""
        ratio inspected / spliced: {statistics.median(rates["inspected"]) / base:.2f}
        load average before: {" ".join(f"{x:.2f}" for x in load_before)}, after: \
{" ".join(f"{x:.2f}" for x in os.getloadavg())}; {host_cost()}""").rstrip()
    )


if __name__ == "__main__":
    sys.exit(main())
