#!/usr/bin/env python3
"""Inspected path benchmark: keep-alive HTTPS requests/s and added latency over HTTP/1.1
and HTTP/2 through the gateway's L7 inspector, next to standalone mitmproxy in regular
(intercepting) mode, the gateway's spliced (uninspected) path and a direct connection,
plus bulk download throughput of each; one run, interleaved rounds.

    .venv/bin/python bench/inspector_bench.py [--requests 300] [--runs 3] [--bytes 128MiB]
        [--baseline REV] [--pyspy PREFIX] [--hog]

`--runs N` rounds, each path once per round in a rotated order; besides the medians the
table gives each path's requests/s over mitmproxy's *in the same round* (median and
range over the N rounds) and the median of its per-round p50 minus mitmproxy's: on a
shared host those paired figures are what a ratio can be read from. `--bytes 0` skips
the bulk rounds.

Wiring (needs root; `inspect_cost_bench.start_rig`): the fake internet's HTTPS sites
(aiohttp, HTTP/1.1 only, certificates from its own CA) are the one upstream of every
path; a sandbox namespace's TCP is redirected to the gateway's transparent listener.
- direct: curl in the host's namespace straight to the site;
- gateway, spliced: `allowed.test` (SNI checked, then spliced);
- gateway, inspected: `other.test` with `host_must_match_sni: true` (every request goes
  through the supervised mitmproxy child behind the gateway's hand-off);
- mitmproxy: `mitmdump` in regular mode on the namespace's host address (exempt from the
  redirect), CONNECT to the site's address (curl `--connect-to`), SNI `other.test`,
  upstream verified against the fake internet's CA; its defaults otherwise;
- `--baseline REV`: the gateway as of git revision REV (and its inspector child), wired
  the same way in a second namespace, inspected: the before/after of a change, one run.

One curl per path per round fetches `--requests` small responses (`/bytes/256`) one
after another over one connection (keep-alive; HTTP/2: one connection, sequential
streams). Columns: requests/s over the reused connection (the first transfer, which
pays the handshakes, is left out; median of rounds), the latency p50 of those requests
and its excess over direct, the protocol curl negotiated with the proxy, and the
proxy's CPU per request (gateway + inspector child, or mitmdump; scheduler run time).
Bulk: one `--bytes` download per path per round (HTTP/1.1), MiB/s (median) and its
ratio to the spliced path (direct runs from the host's namespace, another route).
- squid (ssl-bump): Debian's squid-openssl unpacked beside the installed Squid
  (bench/squid_bump.py), CONNECT other.test, bumped, upstream verified against the fake
  internet's CA; Squid speaks HTTP/1.1 to its clients.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cpuhog
import squid_bump
from gateway_bench import VENV_BIN, _descendants, baseline_tree, cpu_seconds, parse_size
from gateway_transparent_bench import code_revision, stop_proc, wait_listen
from hostcost import describe as host_cost
from inspect_cost_bench import INSPECTED, SPLICED, host_unavailable, start_rig

from stockade.ports import free_port

SMALL = "/bytes/256"
FORMAT = "%{http_code} %{http_version} %{time_total} %{num_connects} %{size_download}\n"


@dataclass
class Route:
    """One way to reach the upstream: how curl is run and whose CPU it costs."""

    label: str
    run: Callable[..., subprocess.CompletedProcess[str]]
    name: str
    args: list[str]
    pid: int | None
    rates: dict[str, list[float]] = field(default_factory=dict)
    lat: dict[str, list[float]] = field(default_factory=dict)
    p50s: dict[str, list[float]] = field(default_factory=dict)  # each round's p50
    proto: dict[str, str] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    bulk: list[float] = field(default_factory=list)


def curl(path: Route, urls: list[str], proto: str) -> list[tuple[str, float, int, int]]:
    """(http_version, seconds, new connections, bytes) of each transfer of one curl run
    fetching `urls` in order; raises on any non-200 answer or a failed run."""
    argv = ["curl", "-sS", "--max-time", "600", f"--{proto}", *path.args, "-w", FORMAT]
    for url in urls:
        argv += ["-o", "/dev/null", url]
    r = path.run(argv, capture_output=True, text=True, timeout=660)
    rows = [line.split() for line in r.stdout.splitlines()]
    if r.returncode != 0 or len(rows) != len(urls) or any(row[0] != "200" for row in rows):
        raise RuntimeError(f"{path.label}: curl failed ({r.returncode}): {r.stderr.strip()!r}")
    return [(row[1], float(row[2]), int(row[3]), int(row[4])) for row in rows]


def cpu_of(path: Route) -> float:
    return cpu_seconds(path.pid) if path.pid is not None else 0.0


def requests_round(path: Route, proto: str, n: int) -> None:
    """One keep-alive run of `n` requests: rate, latencies, protocol and CPU recorded."""
    c0 = cpu_of(path)
    rows = curl(path, [f"https://{path.name}{SMALL}"] * n, proto)
    path.cpu[proto] = path.cpu.get(proto, 0.0) + cpu_of(path) - c0
    reused = rows[1:]
    if any(new for _, _, new, _ in reused):
        raise RuntimeError(f"{path.label}: {proto} connection was not kept alive")
    times = [t for _, t, _, _ in reused]
    path.rates.setdefault(proto, []).append(len(times) / sum(times))
    path.lat.setdefault(proto, []).extend(times)
    path.p50s.setdefault(proto, []).append(statistics.median(times))
    path.proto[proto] = rows[0][0]


def bulk_round(path: Route, nbytes: int) -> None:
    ((_, seconds, _, size),) = curl(path, [f"https://{path.name}/bytes/{nbytes}"], "http1.1")
    if size != nbytes:
        raise RuntimeError(f"{path.label}: {size} of {nbytes} bytes")
    path.bulk.append(nbytes / seconds / 2**20)


def start_mitmproxy(
    tmp: Path, listen: str, upstream_ca: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """Standalone mitmdump in regular (intercepting) mode; returns it and its CA."""
    port = int(listen.rsplit(":", 1)[1])
    conf = tmp / "mitm"
    conf.mkdir()
    proc = subprocess.Popen(
        [str(VENV_BIN / "mitmdump"), "--mode", f"regular@{listen}", "--set", f"confdir={conf}",
         "--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}", "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_listen(listen.rsplit(":", 1)[0], port, proc, timeout=60)
    return proc, conf / "mitmproxy-ca-cert.pem"


def sample(stack: contextlib.ExitStack, pid: int, out: str) -> None:
    """py-spy on `pid` (its CPU samples, collapsed stacks) until `stack` closes; SIGINT
    makes it write `out`."""
    spy = subprocess.Popen(
        [str(VENV_BIN / "py-spy"), "record", "--pid", str(pid), "--rate", "1000",
         "--format", "raw", "--output", out],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    stack.callback(spy.wait, 60)
    stack.callback(spy.send_signal, signal.SIGINT)


def inspector_pid(gateway_pid: int) -> int:
    for pid in _descendants(gateway_pid):
        with contextlib.suppress(OSError):
            if b"inspector" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise RuntimeError("no inspector child found")


def squid_route(stack: contextlib.ExitStack, fi, ns, port: int) -> list[Route]:  # type: ignore[no-untyped-def]
    """Squid with ssl-bump (bench/squid_bump.py) on the namespace's host address, or no
    row (with the reason on stderr) where squid-openssl cannot be had."""
    try:
        proc, d = squid_bump.start(
            f"{ns.host_ip}:{port}", fi.ca_pem, INSPECTED, fi.addresses[INSPECTED]
        )
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"# squid (ssl-bump): no row: {e}", file=sys.stderr)
        return []
    stack.callback(shutil.rmtree, d, True)
    stack.callback(stop_proc, proc)
    wait_listen(ns.host_ip, port, proc, timeout=60)
    time.sleep(1.0)  # it listens before its helpers start: a broken set-up exits by now
    if proc.poll() is not None:
        print(f"# squid (ssl-bump): exited: {squid_bump.log_tail(d)}", file=sys.stderr)
        return []
    args = ["--cacert", str(d / "ca.pem"), "-x", f"http://{ns.host_ip}:{port}"]
    return [Route("squid (ssl-bump)", ns.run, INSPECTED, args, proc.pid)]


def build_paths(stack: contextlib.ExitStack, baseline: str | None) -> list[Route]:
    mport, sport = free_port(), free_port()
    fi, ns, gw, insp_ca = start_rig(stack, exempt_ports=(mport, sport))
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stockade-bench-")))
    before: list[Route] = []
    if baseline:  # the same wiring again (its own namespace) for another commit's gateway
        _, ns_b, gw_b, ca_b = start_rig(stack, code=baseline_tree(tmp, baseline), fi=fi)
        args_b = ["--cacert", str(ca_b), *fi.resolve_args(INSPECTED)]
        before.append(Route(f"gateway@{baseline[:9]}, insp", ns_b.run, INSPECTED, args_b, gw_b.pid))
    mitm, mitm_ca = start_mitmproxy(tmp, f"{ns.host_ip}:{mport}", fi.ca_pem)
    stack.callback(stop_proc, mitm)
    ip = fi.addresses[INSPECTED]
    pin, pin_spliced = fi.resolve_args(INSPECTED), fi.resolve_args(SPLICED)
    proxy = ["-x", f"http://{ns.host_ip}:{mport}", "--connect-to", f"{INSPECTED}:443:{ip}:443"]
    peers = [*before, *squid_route(stack, fi, ns, sport)]
    return [
        Route("direct", subprocess.run, INSPECTED, ["--cacert", fi.ca_pem, *pin], None),
        Route("gateway, spliced", ns.run, SPLICED, ["--cacert", fi.ca_pem, *pin_spliced], gw.pid),
        Route("gateway, inspected", ns.run, INSPECTED, ["--cacert", str(insp_ca), *pin], gw.pid),
        *peers,
        Route(
            "mitmproxy (regular)", ns.run, INSPECTED, ["--cacert", str(mitm_ca), *proxy], mitm.pid
        ),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per keep-alive run")
    ap.add_argument("--runs", type=int, default=3, help="interleaved rounds (median shown)")
    ap.add_argument("--bytes", default="128MiB", help="bulk download size per round")
    ap.add_argument("--baseline", metavar="REV", help="also another commit's gateway, inspected")
    ap.add_argument(
        "--pyspy", metavar="PREFIX",
        help="py-spy the inspector child and mitmdump: PREFIX-inspector.txt, PREFIX-mitm.txt",
    )  # fmt: skip
    ap.add_argument(
        "--hog", action="store_true", help="with a CPU hog on the other core (bench/cpuhog.py)"
    )
    args = ap.parse_args()

    if host_unavailable():
        return 2
    if args.requests < 2 or args.runs < 1:
        print("--requests must be >= 2 and --runs >= 1", file=sys.stderr)
        return 2
    if args.pyspy and not (VENV_BIN / "py-spy").exists():
        print("--pyspy needs py-spy: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    try:
        nbytes = parse_size(args.bytes)  # 0: no bulk rounds
    except ValueError as e:
        print(f"--bytes: {e}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        paths = build_paths(stack, args.baseline)
        if args.pyspy:
            sample(stack, inspector_pid(paths[2].pid or 0), f"{args.pyspy}-inspector.txt")
            sample(stack, paths[-1].pid or 0, f"{args.pyspy}-mitm.txt")
        stack.enter_context(cpuhog.running(cpuhog.other_core() if args.hog else None))
        for i in range(args.runs):  # interleaved: drift on a shared host hits all alike
            order = rotated(paths, i)  # and no path always runs first or last
            for proto in ("http1.1", "http2"):
                for path in order:
                    requests_round(path, proto, args.requests)
            for path in order if nbytes else ():
                bulk_round(path, nbytes)
    print_table(args, nbytes, paths, load_before, time.monotonic() - started)
    return 0


def rotated(paths: list[Route], i: int) -> list[Route]:
    k = i % len(paths)
    return paths[k:] + paths[:k]


def paired(p: Route, mitm: Route, proto: str) -> tuple[list[float], list[float]]:
    """Round by round against mitmproxy in the same round: (rate ratios, p50 excesses in
    seconds). A pair shares the round's load, so their spread is the path's own."""
    ratios = [a / b for a, b in zip(p.rates[proto], mitm.rates[proto], strict=True)]
    excess = [a - b for a, b in zip(p.p50s[proto], mitm.p50s[proto], strict=True)]
    return ratios, excess


def print_table(
    args: argparse.Namespace,
    nbytes: int,
    paths: list[Route],
    load_before: tuple[float, float, float],
    elapsed: float,
) -> None:
    print(
        f"stockade inspector bench ({code_revision()}): {args.requests} keep-alive requests "
        f"of {SMALL} per path per protocol per round, bulk {nbytes / 2**20:.0f} MiB, median of "
        f"{args.runs} interleaved rounds, {os.cpu_count()} CPUs"
    )
    head = f"{'path':<26}{'proto':>6}{'req/s':>8}{'p50 ms':>8}{'+p50 ms':>9}{'CPU us/req':>11}"
    tail = f"{'vs mitm':>9}{'rounds vs mitm':>20}{'p50-mitm ms':>12}"
    print(head + tail)
    print("-" * (len(head) + len(tail)))
    direct = paths[0]
    mitm = paths[-1]
    for proto in ("http1.1", "http2"):
        base = statistics.median(direct.lat[proto])
        mitm_rate = statistics.median(mitm.rates[proto])
        for p in paths:
            rate = statistics.median(p.rates[proto])
            p50 = statistics.median(p.lat[proto])
            per_req = f"{p.cpu[proto] / (args.requests * args.runs) * 1e6:.0f}" if p.pid else "-"
            ratios, excess = paired(p, mitm, proto)
            rounds = f"{statistics.median(ratios):.2f}x {min(ratios):.2f}-{max(ratios):.2f}"
            print(
                f"{p.label:<26}{p.proto[proto]:>6}{rate:>8.0f}{p50 * 1e3:>8.3f}"
                f"{(p50 - base) * 1e3:>+9.3f}{per_req:>11}{rate / mitm_rate:>8.2f}x"
                f"{rounds:>20}{statistics.median(excess) * 1e3:>+12.3f}"
            )
    print(
        "(rounds vs mitm: median and range of each round's req/s over mitmproxy's in that "
        "round; p50-mitm: median of each round's p50 minus mitmproxy's)"
    )
    if not nbytes:
        print("\nbulk download: skipped (--bytes 0)")
    bulk_base = statistics.median(paths[1].bulk) if nbytes else 0.0
    if nbytes:
        print(f"\n{'bulk download':<26}{'MiB/s':>8}{'min-max':>12}{'vs spliced':>11}")
    for p in paths if nbytes else ():
        med = statistics.median(p.bulk)
        spread = f"{min(p.bulk):.0f}-{max(p.bulk):.0f}"
        print(f"{p.label:<26}{med:>8.0f}{spread:>12}{med / bulk_base:>10.0%}")
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\nload average before: {' '.join(f'{x:.2f}' for x in load_before)}, after: "
        f"{load_after}; {elapsed:.0f} s; {host_cost()}"
    )
    print(cpuhog.describe(cpuhog.other_core() if args.hog else None))


if __name__ == "__main__":
    sys.exit(main())
