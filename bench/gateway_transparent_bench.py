#!/usr/bin/env python3
"""Gateway benchmark, transparent (sandbox) path: a client in a network namespace reaches
an upstream directly, through the gateway's transparent listener (nftables redirect,
SO_ORIGINAL_DST, SNI sniff, decision, dial of a checked address) and through the same
gateway as an explicit CONNECT proxy, in one run with interleaved blocks.

    .venv/bin/python bench/gateway_transparent_bench.py [--bytes 512MiB] [--runs 3]
        [--latency-runs 300] [--baseline REV] [--only direct,transparent,explicit]

Wiring (needs root; everything is removed again at exit, Ctrl-C and SIGTERM included):
- a `stockade.testing.testnet.ClientNamespace` (veth /30 from 10.251.0.0/16 taken under testnet's
  allocation lock; nft table `stockade_t_<suffix>`) whose TCP is redirected to the
  gateway's transparent port, except the exempt ports on the host veth address;
- one upstream process (gateway_bench's: ClientHello, then `D` + length or `P`),
  listening on the host veth address at port D (exempt: the **direct** path) and on
  127.0.0.1 at ports D and T;
- `stockade gateway serve`: transparent listener on the host veth address (the nft
  redirect target), proxy listener there too (exempt port), resolver = a dnslib server on
  127.0.0.1 answering `upstream.bench.test` -> 127.0.0.1, `allow_addresses: [127.0.0.0/8]`,
  the namespace's address registered as a task over the control API;
- a client process inside the namespace (this file, `--worker`) that does the timing.
  **transparent**: connect to `<host veth>:T`, nft redirects it to the gateway, which
  reads T from SO_ORIGINAL_DST and dials 127.0.0.1:T; **explicit**: connect to the proxy
  port, `CONNECT upstream.bench.test:D`. All paths then send a real ClientHello (SNI
  `upstream.bench.test`) and the command. The gateway never dials the veth address (it
  is one of its own addresses), which is why it dials the upstream on loopback.

`--baseline REV` adds a second gateway built from another commit; a second nft table
(`stockade_tb_<suffix>`, NAT priority before the namespace's) redirects port B to its
transparent listener, so both gateways serve the same namespace interleaved.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from gateway_bench import (
    LATENCY_BLOCK,
    UPSTREAM_CODE,
    baseline_tree,
    client_hello,
    cpu_seconds,
    parse_size,
    read_server_hello,
    spawn_gateway,
)
from hostcost import describe as host_cost

from stockade.ports import free_port

NAME = "upstream.bench.test"  # the SNI / CONNECT name; the gateway's resolver maps it


# -- the client, run inside the namespace ----------------------------------------------


def worker(spec: dict[str, dict[str, object]]) -> None:
    """Reads one JSON command a line on stdin, answers one JSON line: `{"op": "tput",
    "path": key, "n": bytes}` -> MiB/s; `{"op": "lat", "path": key, "n": count}` ->
    seconds from connect() to the first upstream byte, per connection."""
    hello = client_hello(NAME)

    def open_(path: dict[str, object], cmd: bytes) -> socket.socket:
        host, port = path["addr"]  # type: ignore[misc]
        s = socket.create_connection((host, port), timeout=30)
        authority = path.get("connect")
        if authority:
            s.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    raise RuntimeError("closed during CONNECT")
                head += chunk
            if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                raise RuntimeError(f"CONNECT refused: {head[:120]!r}")
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(hello)
        read_server_hello(s, str(path["addr"]))
        s.sendall(cmd)
        return s

    def tput(path: dict[str, object], nbytes: int) -> float:
        buf = bytearray(1 << 20)
        t0 = time.perf_counter()
        s = open_(path, b"D" + nbytes.to_bytes(8, "big"))
        got = 0
        while got < nbytes:
            n = s.recv_into(buf)
            if n == 0:
                raise RuntimeError(f"short read {got}/{nbytes}")
            got += n
        elapsed = time.perf_counter() - t0
        s.close()
        return nbytes / elapsed / 2**20

    def lat(path: dict[str, object], runs: int) -> list[float]:
        out: list[float] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            s = open_(path, b"P")
            if s.recv(1) != b"!":
                raise RuntimeError("no first byte")
            out.append(time.perf_counter() - t0)
            s.close()
        return out

    for line in sys.stdin:
        req = json.loads(line)
        try:
            path = spec[req["path"]]
            value: object = tput(path, req["n"]) if req["op"] == "tput" else lat(path, req["n"])
            reply: dict[str, object] = {"ok": value}
        except Exception as e:  # reported to the parent, which names the path
            reply = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


class Client:
    """The worker process inside the namespace, driven over pipes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def ask(self, op: str, path: str, n: int) -> object:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "path": path, "n": n}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client exited ({self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{path}: {reply['error']}")
        return reply["ok"]


# -- the host side ----------------------------------------------------------------------


def stop_proc(proc: subprocess.Popen[object] | subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_listen(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{host}:{port} not listening")


def upstream_code() -> str:
    """gateway_bench's upstream, listening on several `host:port`s (argv[3])."""
    head, sep, _ = UPSTREAM_CODE.partition("async def main():")
    if not sep:
        raise RuntimeError("gateway_bench.UPSTREAM_CODE changed shape")
    return head + textwrap.dedent(
        """
        async def main():
            servers = []
            for bind in sys.argv[3].split(","):
                h, _, p = bind.rpartition(":")
                servers.append(await asyncio.start_server(handle, h, int(p), backlog=4096))
            print("ready", flush=True)
            await asyncio.gather(*(s.serve_forever() for s in servers))

        asyncio.run(main())
        """
    )


def start_resolver(stack: contextlib.ExitStack) -> int:
    from dnslib import QTYPE, RR, A
    from dnslib.server import BaseResolver, DNSLogger, DNSServer

    class Resolver(BaseResolver):  # type: ignore[misc]
        def resolve(self, request, handler):  # type: ignore[no-untyped-def]
            reply = request.reply()
            q = request.q
            if str(q.qname).rstrip(".").lower() == NAME and q.qtype == QTYPE.A:
                reply.add_answer(RR(q.qname, QTYPE.A, rdata=A("127.0.0.1"), ttl=300))
            return reply

    port = free_port()
    quiet = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data")
    dns = DNSServer(Resolver(), port=port, address="127.0.0.1", tcp=False, logger=quiet)
    dns.start_thread()
    stack.callback(dns.stop)
    return port


def start_gateway(
    stack: contextlib.ExitStack,
    tmp: Path,
    key: str,
    host_ip: str,
    ports: tuple[int, int],
    upstream_ports: list[int],
    dns_port: int,
    task_address: str,
    code: Path | None = None,
) -> subprocess.Popen[bytes]:

    from stockade.tasks import ControlClient, Task

    tport, pport = ports
    d = tmp / key
    (d / "rules" / "profiles").mkdir(parents=True)
    (d / "rules" / "profiles" / "bench.yaml").write_text(
        textwrap.dedent(
            f"""\
            profile: bench
            description: gateway transparent-path benchmark
            limits: {{egress_bytes: 1000GiB}}
            egress:
              allow:
                - host: {NAME}
                  ports: {json.dumps(sorted(upstream_ports))}
                  reason: the benchmark upstream
            """
        )
    )
    proc = spawn_gateway(d, f"{host_ip}:{tport}", f"{host_ip}:{pport}", dns_port, code)
    stack.callback(stop_proc, proc)
    wait_listen(host_ip, pport, proc)
    wait_listen(host_ip, tport, proc)
    ctl = ControlClient(d / "run" / "gw.sock")
    for attempt in range(100):
        try:
            ctl.register(Task("bench", task_address, "bench"))
            break
        except OSError:
            if attempt == 99:
                raise
            time.sleep(0.05)
    return proc


def baseline_redirect(
    stack: contextlib.ExitStack, hif: str, host_ip: str, dport: int, to_port: int, suffix: str
) -> None:
    """Send the namespace's `host_ip:dport` to the baseline gateway's transparent port:
    a NAT chain ahead of the ClientNamespace's (the first NAT binding wins)."""
    from stockade.testing.testnet import host

    table = f"stockade_tb_{suffix}"
    key = f"skcl-{suffix}-tb"
    host.write_owner(key, None, [], [table])  # a SIGKILLed run is reaped by the next

    def remove() -> None:
        host.remove_resources(None, [], [table])
        host.drop_owner(key)

    stack.callback(remove)
    host.run(
        ["nft", "-f", "-"],
        input=textwrap.dedent(
            f"""\
            table inet {table} {{
              chain prerouting {{
                type nat hook prerouting priority -101; policy accept;
                iifname "{hif}" ip daddr {host_ip} tcp dport {dport} redirect to :{to_port}
              }}
            }}
            """
        ),
    )


@dataclass
class Path_:
    key: str
    name: str
    gateway: subprocess.Popen[bytes] | None
    client: dict[str, object]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="512MiB", help="download size per throughput run")
    ap.add_argument("--runs", type=int, default=3, help="throughput runs (median is shown)")
    ap.add_argument("--latency-runs", type=int, default=300)
    ap.add_argument("--baseline", metavar="REV", help="also run the gateway as of REV")
    ap.add_argument("--only", help="comma-separated subset: direct,transparent,explicit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    from stockade.testing.testnet import ClientNamespace, host

    reason = host.available()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    nbytes = parse_size(args.bytes)
    only = set(args.only.split(",")) if args.only else None
    load_before = os.getloadavg()
    revision = code_revision()
    suffix = f"bench{secrets.token_hex(3)}"
    ports = {k: free_port() for k in ("D", "T", "B", "gw_t", "gw_p", "base_t", "base_p")}
    rows: list[dict[str, object]] = []
    with contextlib.ExitStack() as stack:
        # SIGTERM/SIGHUP and interpreter exit run the whole stack too (testnet's registry)
        host.register_cleanup(stack, stack.close)
        stack.callback(host.unregister_cleanup, stack)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stockade-bench-")))
        ns = ClientNamespace(
            name_suffix=suffix,
            redirect_tcp_port=ports["gw_t"],
            redirect_dns_port=free_port(),
            exempt_tcp_ports=(ports["D"], ports["gw_p"], ports["base_t"], ports["base_p"]),
        )
        stack.callback(ns.stop)
        ns.start()
        hip = ns.host_ip

        # upstream
        blob_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
        fd, blob = tempfile.mkstemp(dir=blob_dir, prefix="stockade-bench-")
        stack.callback(os.unlink, blob)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1 << 20) * 64)  # 64 MiB served again and again
        binds = [f"{hip}:{ports['D']}", f"127.0.0.1:{ports['D']}", f"127.0.0.1:{ports['T']}"]
        if args.baseline:
            binds.append(f"127.0.0.1:{ports['B']}")
        up = subprocess.Popen(
            [sys.executable, "-c", upstream_code(), "0", blob, ",".join(binds)],
            stdout=subprocess.PIPE,
        )
        stack.callback(stop_proc, up)
        assert up.stdout is not None
        if up.stdout.readline().strip() != b"ready":
            raise RuntimeError("upstream did not start")

        dns_port = start_resolver(stack)
        up_ports = [ports["D"], ports["T"], ports["B"]]
        gw = start_gateway(
            stack, tmp, "gw", hip, (ports["gw_t"], ports["gw_p"]), up_ports, dns_port, ns.address
        )
        paths = [
            Path_("direct", "direct (no redirect)", None, {"addr": [hip, ports["D"]]}),
            Path_("transparent", "gateway transparent", gw, {"addr": [hip, ports["T"]]}),
            Path_(
                "explicit",
                "gateway explicit (CONNECT)",
                gw,
                {"addr": [hip, ports["gw_p"]], "connect": f"{NAME}:{ports['D']}"},
            ),
        ]
        paths = [p for p in paths if only is None or p.key in only]
        if args.baseline:
            base = start_gateway(
                stack,
                tmp,
                "baseline",
                hip,
                (ports["base_t"], ports["base_p"]),
                up_ports,
                dns_port,
                ns.address,
                baseline_tree(tmp, args.baseline),
            )
            baseline_redirect(stack, ns.host_if, hip, ports["B"], ports["base_t"], suffix)
            for p in list(paths):
                if p.key == "transparent":
                    paths.append(
                        Path_(
                            "transparent@base",
                            f"transparent @ {args.baseline}",
                            base,
                            {"addr": [hip, ports["B"]]},
                        )
                    )
                elif p.key == "explicit":
                    paths.append(
                        Path_(
                            "explicit@base",
                            f"explicit @ {args.baseline}",
                            base,
                            {"addr": [hip, ports["base_p"]], "connect": f"{NAME}:{ports['D']}"},
                        )
                    )

        proc = ns.popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                json.dumps({p.key: p.client for p in paths}),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        stack.callback(stop_proc, proc)
        client = Client(proc)
        gateways = {id(p.gateway): p.gateway for p in paths if p.gateway is not None}
        for p in paths:  # warm-up, and a check that the path reached the intended gateway
            before = {k: cpu_seconds(g.pid) for k, g in gateways.items()}
            client.ask("lat", p.key, 20)
            moved = {k: cpu_seconds(g.pid) - before[k] for k, g in gateways.items()}
            if p.gateway is not None and max(moved, key=lambda k: moved[k]) != id(p.gateway):
                raise RuntimeError(f"{p.key}: traffic did not go through its gateway")
        rows = measure(client, paths, nbytes, args)
        for g in gateways.values():
            if g.poll() is not None:
                raise RuntimeError(f"a gateway exited ({g.returncode})")
    print_table(rows, nbytes, args, load_before, os.getloadavg(), revision)
    print(host_cost())
    return 0


def measure(
    client: Client, paths: list[Path_], nbytes: int, args: argparse.Namespace
) -> list[dict[str, object]]:
    """Interleaved rounds (every path once per round), as gateway_bench.measure."""
    tputs: dict[str, list[float]] = {p.key: [] for p in paths}
    lats: dict[str, list[float]] = {p.key: [] for p in paths}
    cpu: dict[str, float] = {p.key: 0.0 for p in paths}
    for _ in range(max(args.runs, 1)):
        for p in paths:
            tputs[p.key].append(float(client.ask("tput", p.key, nbytes)))  # type: ignore[arg-type]
    blocks = max(1, -(-args.latency_runs // LATENCY_BLOCK))
    per_block = max(1, args.latency_runs // blocks)
    for _ in range(blocks):
        for p in paths:
            pid = p.gateway.pid if p.gateway is not None else None
            before = cpu_seconds(pid) if pid else 0.0
            lats[p.key] += client.ask("lat", p.key, per_block)  # type: ignore[operator]
            cpu[p.key] += (cpu_seconds(pid) - before) if pid else 0.0
    return [
        {
            "key": p.key,
            "name": p.name,
            "tput": statistics.median(tputs[p.key]),
            "p50": statistics.median(lats[p.key]) * 1000,
            "p90": statistics.quantiles(lats[p.key], n=10)[-1] * 1000,
            "cpu_us": cpu[p.key] / len(lats[p.key]) * 1e6 if p.gateway is not None else None,
        }
        for p in paths
    ]


def code_revision() -> str:
    """HEAD, plus `+dirty` when the gateway's code has uncommitted changes (the bench runs
    the working tree, which others may be editing)."""
    git = ["git", "-C", str(Path(__file__).resolve().parent.parent)]
    try:
        rev = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "gateway", "policy", "stockade"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def print_table(
    rows: list[dict[str, object]],
    nbytes: int,
    args: argparse.Namespace,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    revision: str,
) -> None:
    direct = next((r for r in rows if r["key"] == "direct"), None)
    print(
        f"\nstockade gateway transparent-path bench: client in a network namespace, "
        f"1 tunnel downloading {nbytes / 2**20:.0f} MiB (median of {args.runs} interleaved "
        f"rounds), {args.latency_runs} connect+first-byte samples per path, "
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} before / "
        f"{load_after[0]:.2f} after, code {revision}\n"
    )
    hdr = (
        f"{'path':30} {'MiB/s':>8} {'vs direct':>9} {'p50 ms':>7} {'+p50 ms':>8} "
        f"{'p90 ms':>7} {'CPU us/conn':>11}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        tput = float(r["tput"])  # type: ignore[arg-type]
        p50 = float(r["p50"])  # type: ignore[arg-type]
        vs = f"{tput / float(direct['tput']):.0%}" if direct else "-"  # type: ignore[arg-type]
        added = f"{p50 - float(direct['p50']):+.3f}" if direct else "-"  # type: ignore[arg-type]
        cpu = f"{float(r['cpu_us']):.0f}" if r["cpu_us"] is not None else "-"  # type: ignore[arg-type]
        print(
            f"{r['name']:30} {tput:8.0f} {vs:>9} {p50:7.3f} {added:>8} "
            f"{float(r['p90']):7.3f} {cpu:>11}"  # type: ignore[arg-type]
        )
    print()


if __name__ == "__main__":
    sys.exit(main())
