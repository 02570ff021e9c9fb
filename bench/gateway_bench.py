#!/usr/bin/env python3
"""Gateway benchmark: tunnel throughput, connection set-up latency and idle-tunnel memory,
side by side in one run against a direct connection, mitmproxy (passthrough), Squid and
tinyproxy (allowlisting CONNECT proxies). Everything runs on 127.0.0.1.

    .venv/bin/python bench/gateway_bench.py [--bytes 512MiB] [--latency-runs 300]
                                            [--idle 10000] [--only gateway,direct,...]
                                            [--rate 3] [--hog]

Each proxy gets a CONNECT to `localhost:<upstream port>` followed by a real TLS
ClientHello (SNI `localhost`, so the gateway's sniffer and policy run), then a one-byte
command to the upstream: `D` + 8-byte length (download that many bytes, sent with
sendfile), `P` (answer one byte, then stay idle). The upstream and each proxy are
separate processes; the client is this process (the `--rate` table's clients are
processes of their own: bench/connrate.py). `--hog`: everything with a CPU hog on the
other core (bench/cpuhog.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import connrate
import cpuhog
from hostcost import describe as host_cost

from stockade.ports import free_port

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

UPSTREAM_CODE = textwrap.dedent(
    """
    import asyncio, os, resource, socket, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    port, blob, cc = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    size = os.path.getsize(blob)

    async def handle(reader, writer):
        try:
            hdr = await reader.readexactly(5)
            await reader.readexactly(int.from_bytes(hdr[3:5], "big"))
            # answered as a TLS server would, before the client's next bytes (which the
            # gateway holds until the server's first handshake message went by)
            writer.write(bytes.fromhex("1603030026020000220303") + bytes(32))
            cmd = await reader.readexactly(1)
            if cmd == b"D":
                n = int.from_bytes(await reader.readexactly(8), "big")
                loop = asyncio.get_running_loop()
                with open(blob, "rb") as f:
                    while n > 0:
                        k = min(n, size)
                        await loop.sendfile(writer.transport, f, 0, k)
                        n -= k
            elif cmd == b"P":
                writer.write(b"!")
                await writer.drain()
                await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        for sock in srv.sockets:  # accepted connections inherit it
            if cc:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        print("ready", flush=True)
        await srv.serve_forever()

    asyncio.run(main())
    """
)


def client_hello(sni: str) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def read_server_hello(s: socket.socket, name: str) -> None:
    """The upstream's ServerHello head, sent before it reads the command (UPSTREAM_CODE)."""
    got = b""
    while len(got) < connrate.SERVER_HELLO_LEN:
        chunk = s.recv(connrate.SERVER_HELLO_LEN - len(got))
        if not chunk:
            raise RuntimeError(f"{name}: closed before the ServerHello")
        got += chunk


def parse_size(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


LATENCY_BLOCK = 50

BASELINE_MAIN = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from stockade.cli import main; sys.exit(main(sys.argv[1:]))"
)


def raise_nofile(want: int) -> int:
    """Raise RLIMIT_NOFILE (soft and hard) to `want` where allowed (root may raise the hard
    limit up to fs.nr_open), else the soft limit to the hard one; returns the limit set."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limit in (max(want, hard), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            return limit
        except (ValueError, OSError):
            continue
    return hard


def wait_port(port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} not listening")


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and its live descendants (all threads) in seconds, from the
    scheduler's exact run time (/proc/PID/task/*/schedstat, ns): /proc/PID/stat is only
    tick-sampled on this kernel, which miscounts sub-millisecond bursts. Descendants
    count because some proxies (tinyproxy) serve connections in worker processes."""
    total = 0
    for proc in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{proc}/task").iterdir():
                with contextlib.suppress(OSError):
                    total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def cpu_seconds_ticks(pid: int) -> float:
    """CPU time of a process and its live descendants from /proc/PID/stat (utime + stime:
    tick-sampled, but it keeps the time of threads that have exited, which schedstat
    loses). For proxies that serve each connection in a short-lived thread (tinyproxy)."""
    ticks = 0
    for proc in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{proc}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@dataclass
class Proxy:
    name: str
    port: int | None  # None: direct
    proc: subprocess.Popen[bytes] | None = None
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    thread_per_conn: bool = False  # CPU then read by cpu_seconds_ticks

    def cpu(self) -> float:
        if self.proc is None:
            return 0.0
        read = cpu_seconds_ticks if self.thread_per_conn else cpu_seconds
        return read(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for fn in self.cleanup:
            with contextlib.suppress(Exception):
                fn()


class Bench:
    def __init__(self, upstream_port: int, hello: bytes) -> None:
        self.upstream_port = upstream_port
        self.hello = hello
        self.opened_at = 0.0  # perf_counter when the last open() had its tunnel

    def open(self, proxy: Proxy, cmd: bytes) -> socket.socket:
        if proxy.port is None:
            s = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30)
        else:
            s = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
            auth = f"localhost:{self.upstream_port}"
            s.sendall(f"CONNECT {auth} HTTP/1.1\r\nHost: {auth}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    raise RuntimeError(f"{proxy.name}: closed during CONNECT")
                head += chunk
            if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                raise RuntimeError(f"{proxy.name}: CONNECT refused: {head[:80]!r}")
        self.opened_at = time.perf_counter()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(self.hello)
        read_server_hello(s, proxy.name)
        s.sendall(cmd)  # as a TLS client's next bytes, after the server's first flight
        return s

    def throughput(self, proxy: Proxy, nbytes: int) -> float:
        """MiB/s of one tunnel downloading `nbytes`."""
        buf = bytearray(1 << 20)
        t0 = time.perf_counter()
        s = self.open(proxy, b"D" + nbytes.to_bytes(8, "big"))
        got = 0
        while got < nbytes:
            n = s.recv_into(buf)
            if n == 0:
                raise RuntimeError(f"{proxy.name}: short read {got}/{nbytes}")
            got += n
        elapsed = time.perf_counter() - t0
        s.close()
        return nbytes / elapsed / 2**20

    def latency(self, proxy: Proxy, runs: int) -> list[tuple[float, float]]:
        """Seconds from connect() to the first upstream byte through the tunnel, and of
        that, to the tunnel being open (connected; through a proxy: its `200` read)."""
        out: list[tuple[float, float]] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            s = self.open(proxy, b"P")
            if s.recv(1) != b"!":
                raise RuntimeError(f"{proxy.name}: no first byte")
            out.append((time.perf_counter() - t0, self.opened_at - t0))
            s.close()
        return out

    def idle(self, proxy: Proxy, n: int) -> tuple[int, float]:
        """Hold `n` idle tunnels; returns (tunnels, RSS growth KiB per tunnel)."""
        assert proxy.proc is not None
        warm = [self.open(proxy, b"P") for _ in range(50)]  # first-use allocations
        for s in warm:
            s.recv(1)
            s.close()
        time.sleep(1.0)
        before = rss_kib(proxy.proc.pid)
        held: list[socket.socket] = []
        try:
            for _ in range(n):
                s = self.open(proxy, b"P")
                if s.recv(1) != b"!":
                    raise RuntimeError("tunnel not established")
                held.append(s)
            time.sleep(1.0)
            after = rss_kib(proxy.proc.pid)
        finally:
            for s in held:
                s.close()
        return len(held), (after - before) / max(1, len(held))


# -- proxies ------------------------------------------------------------------------------


def baseline_tree(tmp: Path, rev: str, n: int = 0) -> Path:
    """Another commit's code as an importable `stockade` package (the repo maps its
    top-level folders to `stockade.*`; git archive + symlinks rebuild that mapping);
    `n` numbers the trees of one run."""
    suffix = f"-{n}" if n else ""
    src = tmp / f"baseline-src{suffix}"
    src.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    # byte-compiled now, as this checkout's installed tree already is: a module first
    # imported during the samples (on a first event, a first relay) would otherwise be
    # compiled inside them and charged to the baseline's CPU per connection
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True,
                   stdout=subprocess.DEVNULL)
    pkg = tmp / f"baseline-pkg{suffix}" / "stockade"
    pkg.mkdir(parents=True)
    for entry in (src / "stockade").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for sub in ("policy", "gateway", "broker", "launcher"):
        (pkg / sub).symlink_to(src / sub)
    return pkg.parent


def spawn_gateway(
    d: Path,
    transparent: str,
    proxy: str,
    dns_port: int,
    code: Path | None = None,
    **gateway: Any,
) -> subprocess.Popen[bytes]:
    """Write `d`/stockade.yaml (rules in `d`/rules, resolver on 127.0.0.1:`dns_port`,
    loopback upstreams allowed) and start `stockade gateway serve` on it: this tree's, or
    the build in `code` (see --baseline)."""
    import yaml

    cfg = {
        "rules_dir": str(d / "rules"),
        "state_dir": str(d / "state"),
        "log_dir": str(d / "log"),
        "run_dir": str(d / "run"),
        "gateway": {
            "transparent_listen": [transparent],
            "proxy_listen": [proxy],
            "control_socket": str(d / "run" / "gw.sock"),
            "metrics_listen": f"127.0.0.1:{free_port()}",
            "resolvers": [f"127.0.0.1:{dns_port}"],
            "allow_addresses": ["127.0.0.0/8"],
            "max_connections_per_task": 100000,
            **gateway,
        },
    }
    (d / "stockade.yaml").write_text(yaml.safe_dump(cfg))
    prof = os.environ.get("STOCKADE_BENCH_PROFILE")  # a profiling wrapper script to run under
    prefix = [sys.executable, prof] if prof else [str(VENV_BIN / "stockade")]
    env = None
    if code is not None:  # its package first on sys.path, ahead of the editable install
        prefix = [sys.executable, "-c", BASELINE_MAIN, str(code)]
        # and in its children's (the inspector runs as `python -m stockade`, which puts
        # the working directory first: not this checkout's, whose `stockade/` would win)
        env = {**os.environ, "PYTHONPATH": str(code)}
    return subprocess.Popen(
        [*prefix, "gateway", "serve", "--no-dns", "--config", str(d / "stockade.yaml")],
        stdout=subprocess.DEVNULL,
        env=env,
        cwd=d if code is not None else None,
    )


def start_baseline(tmp: Path, rev: str, n: int, upstream_port: int) -> Proxy:
    return start_gateway(
        tmp, f"gateway @ {rev} (splice)", upstream_port, True, baseline_tree(tmp, rev, n)
    )


def start_gateway(
    tmp: Path, name: str, upstream_port: int, splice: bool, code: Path | None = None
) -> Proxy:
    """`code`: a directory holding another build's `stockade` package (see --baseline)."""
    from dnslib import QTYPE, RR, A
    from dnslib.server import BaseResolver, DNSLogger, DNSServer

    class LocalhostResolver(BaseResolver):  # type: ignore[misc]
        def resolve(self, request, handler):  # type: ignore[no-untyped-def]
            reply = request.reply()
            q = request.q
            if str(q.qname).rstrip(".").lower() == "localhost" and q.qtype == QTYPE.A:
                reply.add_answer(RR(q.qname, QTYPE.A, rdata=A("127.0.0.1"), ttl=300))
            return reply

    dns_port = free_port()
    quiet = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data")
    dns = DNSServer(
        LocalhostResolver(), port=dns_port, address="127.0.0.1", tcp=False, logger=quiet
    )
    dns.start_thread()
    d = tmp / name
    (d / "rules" / "profiles").mkdir(parents=True)
    (d / "rules" / "profiles" / "bench.yaml").write_text(
        textwrap.dedent(
            f"""\
            profile: bench
            description: gateway benchmark
            limits: {{egress_bytes: 1000GiB}}
            egress:
              allow:
                - host: localhost
                  ports: [{upstream_port}]
                  reason: the benchmark upstream
            """
        )
    )
    port = free_port()
    proc = spawn_gateway(
        d, f"127.0.0.1:{free_port()}", f"127.0.0.1:{port}", dns_port, code, splice=splice
    )
    wait_port(port, proc)
    from stockade.tasks import ControlClient, Task

    ctl = ControlClient(d / "run" / "gw.sock")
    for _ in range(100):
        try:
            ctl.register(Task("bench", "127.0.0.1", "bench"))
            break
        except OSError:
            time.sleep(0.05)
    return Proxy(name, port, proc, [dns.stop])


def start_mitmproxy(tmp: Path) -> Proxy | None:
    exe = VENV_BIN / "mitmdump"
    if not exe.exists():
        return None
    port = free_port()
    conf = tmp / "mitm"
    conf.mkdir()
    proc = subprocess.Popen(
        [
            str(exe),
            "--listen-host",
            "127.0.0.1",
            "-p",
            str(port),
            "--ignore-hosts",
            ".*",
            "--set",
            f"confdir={conf}",
            "-q",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_port(port, proc, timeout=60)
    return Proxy("mitmproxy (passthrough)", port, proc)


def start_squid(tmp: Path, upstream_port: int) -> Proxy | None:
    exe = shutil.which("squid")
    if not exe:
        return None
    d = tmp / "squid"
    d.mkdir()
    d.chmod(0o777)
    port = free_port()
    conf = d / "squid.conf"
    conf.write_text(
        textwrap.dedent(
            f"""\
            http_port 127.0.0.1:{port}
            pid_filename {d}/squid.pid
            cache_log {d}/cache.log
            access_log none
            cache deny all
            coredump_dir {d}
            hosts_file /etc/hosts
            max_filedescriptors 19000
            shutdown_lifetime 0 seconds
            acl allowed dstdomain localhost
            acl bench_port port {upstream_port}
            acl CONNECT method CONNECT
            http_access allow CONNECT allowed bench_port
            http_access deny all
            """
        )
    )
    proc = subprocess.Popen(
        [exe, "-N", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_port(port, proc, timeout=60)
    return Proxy("squid (CONNECT allowlist)", port, proc)


def start_tinyproxy(tmp: Path, upstream_port: int) -> Proxy | None:
    exe = shutil.which("tinyproxy")
    if not exe:
        return None
    d = tmp / "tinyproxy"
    d.mkdir()
    d.chmod(0o777)
    port = free_port()
    (d / "filter").write_text("^localhost$\n")
    conf = d / "tinyproxy.conf"
    conf.write_text(
        textwrap.dedent(
            f"""\
            Port {port}
            Listen 127.0.0.1
            Timeout 600
            MaxClients 19000
            LogLevel Critical
            PidFile "{d}/tinyproxy.pid"
            ConnectPort {upstream_port}
            Filter "{d}/filter"
            FilterType ere
            FilterDefaultDeny Yes
            """
        )
    )
    proc = subprocess.Popen(
        [exe, "-d", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_port(port, proc, timeout=30)
    # tinyproxy 1.11 serves each connection in a thread that exits afterwards
    return Proxy("tinyproxy (CONNECT allowlist)", port, proc, thread_per_conn=True)


def start_floor(upstream_port: int) -> Proxy:
    """bench/floor_proxy.py: the hops of a CONNECT proxy with no work of its own."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("floor_proxy.py")),
            str(port),
            str(upstream_port),
        ],
        stdout=subprocess.DEVNULL,
    )
    wait_port(port, proc, timeout=30)
    return Proxy("python relay floor (no policy)", port, proc)


@contextlib.contextmanager
def upstream(tmp: Path, cc: str) -> Iterator[int]:
    blob = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    fd, blob_path = tempfile.mkstemp(dir=blob, prefix="stockade-bench-")
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1 << 20) * 64)  # 64 MiB served again and again
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", UPSTREAM_CODE, str(port), blob_path, cc], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        os.unlink(blob_path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="512MiB", help="download size per throughput run")
    ap.add_argument("--runs", type=int, default=3, help="throughput runs (median is shown)")
    ap.add_argument("--latency-runs", type=int, default=300)
    ap.add_argument(
        "--idle",
        type=int,
        default=10000,
        help="idle tunnels for the RSS test "
        "(the bench raises RLIMIT_NOFILE for it where allowed, e.g. as root; otherwise "
        "capped by the hard limit: the gateway holds two sockets per tunnel)",
    )
    ap.add_argument(
        "--idle-all",
        action="store_true",
        help="run the idle-tunnel test for every proxy, not only the gateway",
    )
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="also run the gateway as of git revision REV, interleaved with this tree's "
        "(A/B of a change on a noisy host); REV,REV2,...: one gateway per revision. "
        "A baseline runs from an extracted tree, which costs it CPU per connection this "
        "tree's gateway does not pay: compare revisions as baselines of one run "
        "(e.g. main,HEAD), not a baseline with this tree's row",
    )
    ap.add_argument(
        "--upstream-cc",
        default="",
        metavar="NAME",
        help="TCP congestion control of the upstream's connections (the sender in the "
        "throughput test), e.g. cubic for a direct baseline without bbr's pacing; "
        "default: the system's",
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="new connections/s with keep-alive off (bench/connrate.py): window length, "
        "--runs windows per path, interleaved; 0: skip",
    )
    ap.add_argument(
        "--hog",
        action="store_true",
        help="run everything with a CPU hog spinning on the other core (bench/cpuhog.py)",
    )
    ap.add_argument(
        "--only",
        help="comma-separated subset: "
        "direct,gateway,gateway-copy,floor,mitmproxy,squid,tinyproxy "
        "(a --baseline always runs)",
    )
    args = ap.parse_args()
    nbytes = parse_size(args.bytes)
    hard = raise_nofile(2 * args.idle + 1000)  # inherited by the upstream and the proxies
    idle_n = min(args.idle, (hard - 300) // 2)
    only = set(args.only.split(",")) if args.only else None

    def wanted(key: str) -> bool:
        return only is None or key in only or key.startswith("baseline")

    hello = client_hello("localhost")
    rows: list[dict[str, object]] = []
    rates: list[tuple[str, str, list[connrate.Rate]]] = []
    load_before = 0.0
    with tempfile.TemporaryDirectory(prefix="stockade-bench-") as tmpdir:
        tmp = Path(tmpdir)
        with upstream(tmp, args.upstream_cc) as up_port:
            bench = Bench(up_port, hello)
            starters: list[tuple[str, Callable[[], Proxy | None]]] = [
                ("direct", lambda: Proxy("direct", None)),
                ("gateway", lambda: start_gateway(tmp, "stockade gateway (splice)", up_port, True)),
                (
                    "gateway-copy",
                    lambda: start_gateway(tmp, "stockade gateway (copy loop)", up_port, False),
                ),
                *(
                    (f"baseline:{rev}", functools.partial(start_baseline, tmp, rev, i, up_port))
                    for i, rev in enumerate(args.baseline.split(",") if args.baseline else ())
                ),
                ("floor", lambda: start_floor(up_port)),
                ("mitmproxy", lambda: start_mitmproxy(tmp)),
                ("squid", lambda: start_squid(tmp, up_port)),
                ("tinyproxy", lambda: start_tinyproxy(tmp, up_port)),
            ]
            proxies: list[tuple[str, Proxy]] = []
            try:
                for key, start in starters:
                    if not wanted(key):
                        continue
                    try:
                        proxy = start()
                    except Exception as e:  # a missing/broken peer must not sink the run
                        print(f"# {key}: could not start: {e}", file=sys.stderr)
                        continue
                    if proxy is None:
                        if not key.startswith("baseline"):
                            print(f"# {key}: not installed", file=sys.stderr)
                        continue
                    proxies.append((key, proxy))  # before the warm-up: stopped if it fails
                    bench.latency(proxy, 20)  # warm-up: caches, first-use allocations
                load_before = os.getloadavg()[0]
                with cpuhog.running(cpuhog.other_core() if args.hog else None):
                    rows = measure(bench, proxies, nbytes, args, idle_n)
                    rates = measure_rates(bench, proxies, args)
            finally:
                for _, proxy in proxies:
                    proxy.stop()
    print_table(rows, nbytes, args)
    if rates:
        connrate.print_rates(rates, args.rate)
    print(cpuhog.describe(cpuhog.other_core() if args.hog else None))
    # context for reading the wall-clock columns (the bench itself raises it by ~1)
    load = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load:.2f} after")
    print(host_cost())
    return 0


def measure(
    bench: Bench,
    proxies: list[tuple[str, Proxy]],
    nbytes: int,
    args: argparse.Namespace,
    idle_n: int,
) -> list[dict[str, object]]:
    """Interleaved rounds (every path once per round), so drift on a shared machine
    affects all paths alike; then the idle-tunnel test, one proxy at a time."""
    tputs: dict[str, list[float]] = {k: [] for k, _ in proxies}
    lats: dict[str, list[tuple[float, float]]] = {k: [] for k, _ in proxies}
    cpu: dict[str, float] = {k: 0.0 for k, _ in proxies}
    for _ in range(max(args.runs, 1)):
        for key, proxy in proxies:
            tputs[key].append(bench.throughput(proxy, nbytes))
    # latency in blocks of at most LATENCY_BLOCK samples, every path once per block
    blocks = max(1, -(-args.latency_runs // LATENCY_BLOCK))
    per_block = max(1, args.latency_runs // blocks)
    for _ in range(blocks):
        for key, proxy in proxies:
            before = proxy.cpu()
            lats[key] += bench.latency(proxy, per_block)
            cpu[key] += proxy.cpu() - before
    rows: list[dict[str, object]] = []
    for key, proxy in proxies:
        totals = [t for t, _ in lats[key]]
        row: dict[str, object] = {
            "name": proxy.name,
            "key": key,
            "tput": statistics.median(tputs[key]),
            "tput_range": (min(tputs[key]), max(tputs[key])),
            "p50": statistics.median(totals) * 1000,
            "p90": statistics.quantiles(totals, n=10)[-1] * 1000,
            # where the set-up time goes: to an open tunnel, then first bytes -> answer
            "open_p50": statistics.median(o for _, o in lats[key]) * 1000,
            "answer_p50": statistics.median(t - o for t, o in lats[key]) * 1000,
            "cpu_us": cpu[key] / len(totals) * 1e6 if proxy.proc else None,
        }
        if proxy.proc is not None and (key == "gateway" or args.idle_all):
            row["idle_n"], row["idle_kib"] = bench.idle(proxy, idle_n)
        rows.append(row)
        print(f"# {proxy.name}: done", file=sys.stderr)
    return rows


def measure_rates(
    bench: Bench, proxies: list[tuple[str, Proxy]], args: argparse.Namespace
) -> list[tuple[str, str, list[connrate.Rate]]]:
    """--runs windows of --rate seconds per path, every path once per round."""
    if args.rate <= 0:
        return []
    windows: dict[str, list[connrate.Rate]] = {k: [] for k, _ in proxies}
    for _ in range(max(args.runs, 1)):
        for key, proxy in proxies:
            cpu = proxy.cpu if proxy.proc is not None else None
            windows[key].append(
                connrate.measure(proxy.port, bench.upstream_port, bench.hello, args.rate, cpu)
            )
    return [(key, proxy.name, windows[key]) for key, proxy in proxies]


def system_cc() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    return "?"


def print_table(rows: list[dict[str, object]], nbytes: int, args: argparse.Namespace) -> None:
    direct = next((r for r in rows if r["key"] == "direct"), None)
    mitm = next((r for r in rows if r["key"] == "mitmproxy"), None)
    print(
        f"\nstockade gateway bench: 1 tunnel downloading {nbytes / 2**20:.0f} MiB "
        f"(median of {args.runs} interleaved rounds), {args.latency_runs} connect+first-byte "
        "samples per path, "
        f"{os.cpu_count()} CPUs, upstream congestion control {args.upstream_cc or system_cc()}"
        f"{'' if args.upstream_cc else ' (system)'}\n"
    )
    hdr = (
        f"{'path':32} {'MiB/s':>8} {'vs direct':>9} {'vs mitm':>8} "
        f"{'p50 ms':>7} {'+p50 ms':>8} {'p90 ms':>7} {'CPU us/conn':>11} "
        f"{'idle KiB/tunnel':>18}  {'MiB/s min-max':>13} {'open p50':>8} {'answer p50':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        tput = float(r["tput"])  # type: ignore[arg-type]
        p50 = float(r["p50"])  # type: ignore[arg-type]
        vs_direct = f"{tput / float(direct['tput']):.0%}" if direct else "-"  # type: ignore[arg-type]
        vs_mitm = f"{tput / float(mitm['tput']):.2f}x" if mitm else "-"  # type: ignore[arg-type]
        added = f"{p50 - float(direct['p50']):+.3f}" if direct else "-"  # type: ignore[arg-type]
        idle = (
            f"{float(r['idle_kib']):.1f} ({r['idle_n']})"  # type: ignore[arg-type]
            if "idle_kib" in r
            else "-"
        )
        cpu = f"{float(r['cpu_us']):.0f}" if r.get("cpu_us") is not None else "-"  # type: ignore[arg-type]
        lo, hi = r["tput_range"]  # type: ignore[misc]
        span = f"{lo:.0f}-{hi:.0f}"
        print(
            f"{r['name']:32} {tput:8.0f} {vs_direct:>9} {vs_mitm:>8} {p50:7.3f} "
            f"{added:>8} {float(r['p90']):7.3f} {cpu:>11} {idle:>18}  "
            f"{span:>13} {float(r['open_p50']):8.3f} {float(r['answer_p50']):10.3f}"  # type: ignore[arg-type]
        )  # type: ignore[arg-type]
    print(
        "open p50: connect() to an open tunnel (through a proxy: its 200 read); answer p50: "
        "the ClientHello sent to the first byte back (medians of each part)"
    )


if __name__ == "__main__":
    sys.exit(main())
