"""Fixtures for launcher tests with real namespaces, nftables and cgroups.

`lab` gives a started Launcher on unique names (nft table, interface prefix, cgroup parent,
address pool, state and scratch dirs), control servers of gateway and broker registries
(real `make_control_app` on temp Unix sockets), and host-side observers on the ports the
sandbox traffic is redirected to: a TCP listener on the transparent port that records the
original destination (SO_ORIGINAL_DST), a DNS-port listener (UDP and TCP) and a broker-port
HTTP listener that answers with the task id its registry maps the caller's address to.
Everything is removed at teardown, also on failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import socket
import struct
import subprocess
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from polling import eventually
from stockade.launcher import Launcher, RunResult, SandboxSpec, mounts
from stockade.launcher.cgroups import remove_parent
from stockade.policy.model import ExportPolicy, Limits, Profile, SyscallRelaxation

from stockade.config import Config
from stockade.events import read_events, validate
from stockade.tasks import TaskRegistry, make_control_app, start_control_server

SO_ORIGINAL_DST = 80


def _bound(kind: int, port: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    if kind == socket.SOCK_STREAM:
        s.listen(64)
    s.settimeout(0.2)
    return s


def _bound_pair() -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket on the same free port (other suites run concurrently)."""
    for _ in range(50):
        u = _bound(socket.SOCK_DGRAM)
        try:
            return u, _bound(socket.SOCK_STREAM, u.getsockname()[1])
        except OSError:
            u.close()
    raise RuntimeError("no port free for both UDP and TCP")


@dataclass
class Observed:
    tcp: list[tuple[str, str, int]] = field(default_factory=list)  # (peer, orig dst, port)
    dns: list[tuple[str, str]] = field(default_factory=list)  # (peer, "udp"|"tcp")
    broker: list[str] = field(default_factory=list)  # peers
    trap: list[str] = field(default_factory=list)  # peers that reached a "host service"


class _Servers:
    """Blocking listener threads; each closes when `stop` is set."""

    def __init__(self, obs: Observed, broker_registry: TaskRegistry) -> None:
        self.obs = obs
        self.reg = broker_registry
        self.stop = threading.Event()
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []


    def _loop(self, s: socket.socket, handle: Any) -> None:
        while not self.stop.is_set():
            try:
                if s.type == socket.SOCK_STREAM:
                    c, peer = s.accept()
                    with c:
                        c.settimeout(2)
                        handle(c, peer)
                else:
                    data, peer = s.recvfrom(4096)
                    handle(s, peer, data)
            except (TimeoutError, OSError):
                continue

    def start(self, s: socket.socket, handle: Any) -> None:
        self.socks.append(s)
        t = threading.Thread(target=self._loop, args=(s, handle), daemon=True)
        t.start()
        self.threads.append(t)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=2)
        for s in self.socks:
            s.close()


@dataclass
class Lab:
    launcher: Launcher
    config: Config
    ruleset: Any
    obs: Observed
    gateway_registry: TaskRegistry
    broker_registry: TaskRegistry
    tmp: Path
    trap_port: int

    def run(self, argv: list[str], profile: str = "test", **kw: Any) -> RunResult:
        return self.launcher.run(SandboxSpec(profile=profile, argv=argv, **kw), self.ruleset)

    def py(self, code: str, profile: str = "test", **kw: Any) -> RunResult:
        return self.run(["python3", "-c", code], profile=profile, **kw)

    def background(
        self, argv: list[str], profile: str = "test", start_timeout: float = 10.0, **kw: Any
    ) -> tuple[threading.Thread, dict[str, Any]]:
        """Run a sandbox in a thread: the thread, and a box with the sandbox's `list()` row
        once it is running (polled every 10 ms for up to `start_timeout` s) and, when it
        ends, its `result`."""
        box: dict[str, Any] = {}
        known = {r["task_id"] for r in self.launcher.list()}

        def go() -> None:
            box["result"] = self.run(argv, profile=profile, **kw)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        new = eventually(lambda: [r for r in self.launcher.list()
                                  if r["task_id"] not in known and r["state"] == "running"],
                         timeout=start_timeout, interval=0.01)
        if not new:
            raise AssertionError(f"the {profile} sandbox did not start")
        box.update(new[0])
        return t, box

    def events(self, task_id: str) -> list[dict[str, Any]]:
        evs = [e for e in read_events(self.config.events_file)
               if e.get("labels", {}).get("task_id") == task_id]
        for e in evs:
            validate(e)
        return evs

    def bypass(self, task_id: str) -> list[dict[str, Any]]:
        return [e for e in self.events(task_id) if e["event"]["action"] == "bypass_attempt"]


def command_running(task_id: str, comm: str) -> bool:
    """True when a process named `comm` sits in the sandbox's cgroup (v1 or v2)."""
    for procs in Path("/sys/fs/cgroup").glob(f"**/{task_id}/cgroup.procs"):
        for pid in procs.read_text().split():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                    return True
            except OSError:
                continue
    return False


def runsc(lab: Lab, *args: str) -> str:
    """A runsc subcommand with the launcher's global flags (its state root): its stdout."""
    from stockade.launcher.backends.gvisor import BACKEND

    return subprocess.run([*BACKEND._flags(lab.launcher.s), *args], capture_output=True,
                          text=True, timeout=30, check=False).stdout


def runsc_ids(lab: Lab) -> list[str]:
    """The containers runsc knows under the launcher's state root (a task id each)."""
    return [c["id"] for c in json.loads(runsc(lab, "list", "-format=json") or "null") or []]


def gvisor_command_running(lab: Lab, task_id: str, comm: str) -> bool:
    """`command_running` for the gVisor tier: its processes live in gVisor's kernel, so ask
    `runsc ps` (whose JSON form has only pids: the table's last column is the command)."""
    rows = runsc(lab, "ps", task_id).splitlines()[1:]
    return any(row.split()[-1] == comm for row in rows if row.split())


@contextlib.contextmanager
def control_server(registry: TaskRegistry, sock: Path) -> Iterator[None]:
    """A task control server for `registry` on `sock`, on an event loop in a thread of its
    own (a gateway's or a broker's registry, outside the lab's)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(
        start_control_server(make_control_app(registry), sock), loop).result(10)
    try:
        yield
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def profiles() -> dict[str, Profile]:
    """The lab's profiles. The lab's gateway, DNS firewall and broker are observers that
    answer everything: no fence self-test could pass against them, so every profile is
    `selftest: sampled` and the lab samples none (launcher.selftest.sample_rate 0); the
    self-test runs against the real stack (test_launcher_selftest.py)."""
    small = Limits(cpus=1.0, memory=64 * 2**20, disk=8 * 2**20, pids=64, ttl=30)
    profiles = {
        "test": Profile("test", "launcher tests", limits=small,
                        exports=ExportPolicy(max_file_bytes=4096, max_total_bytes=6000,
                                             types=("text", "json"))),
        "short": Profile("short", "short ttl", limits=Limits(memory=64 * 2**20, disk=8 * 2**20,
                                                             pids=64, ttl=2)),
        "vm": Profile("vm", "asks for a microVM", isolation="microvm", limits=small),
        "vm-half": Profile("vm-half", "a microVM of half a CPU", isolation="microvm",
                           limits=dataclasses.replace(small, cpus=0.5)),
        "vm-short": Profile("vm-short", "a microVM with a short ttl", isolation="microvm",
                            limits=Limits(cpus=1.0, memory=64 * 2**20, disk=8 * 2**20, pids=64,
                                          ttl=20),
                            exports=ExportPolicy(max_file_bytes=4096, max_total_bytes=6000,
                                                 types=("text", "json"))),
        "gv": Profile("gv", "asks for gVisor", isolation="gvisor", limits=small),
        "debug": Profile("debug", "ptrace for debuggers", limits=small,
                         syscalls=SyscallRelaxation(frozenset({"ptrace"}), "debugger tests")),
    }
    return {k: dataclasses.replace(p, selftest="sampled") for k, p in profiles.items()}


@pytest.fixture(params=["test", "gv"])
def tier(request: pytest.FixtureRequest, lab: Lab) -> str:
    """The profile of a test that runs in the container tier (`test`) and in the gVisor
    tier (`gv`, skipped with the reason where runsc cannot run)."""
    if request.param == "gv":
        from stockade.launcher.backends.gvisor import BACKEND

        why = BACKEND.problem(lab.launcher.s)
        if why is not None:
            pytest.skip(f"gVisor unavailable: {why}")
    return str(request.param)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    if subprocess.run(["nft", "list", "tables"], capture_output=True).returncode != 0:
        pytest.skip("nftables unavailable")
    tmp = tmp_path_factory.mktemp("launcher")
    sfx = secrets.token_hex(3)
    octet = 100 + secrets.randbelow(100)
    # listeners bound first, on free ports; the config then names those ports
    dns_udp, dns_tcp = _bound_pair()
    socks = {"tp": _bound(socket.SOCK_STREAM), "broker": _bound(socket.SOCK_STREAM),
             "trap": _bound(socket.SOCK_STREAM)}
    ports = {k: v.getsockname()[1] for k, v in socks.items()}
    ports["dns"] = dns_udp.getsockname()[1]
    cfg = Config.model_validate({
        "rules_dir": str(tmp / "rules"),
        "state_dir": str(tmp / "state"), "log_dir": str(tmp / "log"), "run_dir": str(tmp / "run"),
        "events": {"file": str(tmp / "log" / "events.jsonl")},
        "gateway": {"transparent_listen": [f"0.0.0.0:{ports['tp']}"],
                    "control_socket": str(tmp / "run" / "gateway.sock")},
        "dns": {"listen": [f"0.0.0.0:{ports['dns']}"]},
        "broker": {"listen": f"0.0.0.0:{ports['broker']}",
                   "control_socket": str(tmp / "run" / "broker.sock")},
        "launcher": {"nft_table": f"stockade_lt{sfx}", "name_prefix": f"l{sfx[:3]}",
                     "cgroup_parent": f"stockade_lt{sfx}", "scratch_dir": str(tmp / "sbx"),
                     "address_pool": f"10.213.{octet}.0/24",
                     "nflog_group": 7300 + secrets.randbelow(99),
                     # KVM guests hang on the development VMs: the tests use TCG everywhere;
                     # snapshot starts only where a test asks (test_microvm_snapshot.py)
                     "microvm": {"accel": "tcg", "snapshots": False},
                     "selftest": {"sample_rate": 0.0}},
    })
    obs = Observed()
    greg, breg = TaskRegistry(), TaskRegistry()
    loop = asyncio.new_event_loop()
    lt = threading.Thread(target=_run_loop, args=(loop,), daemon=True)
    lt.start()
    runners = [
        asyncio.run_coroutine_threadsafe(
            start_control_server(make_control_app(reg), path), loop).result(10)
        for reg, path in ((greg, cfg.gateway.control_socket), (breg, cfg.broker.control_socket))
    ]
    srv = _Servers(obs, breg)

    def on_tcp(c: socket.socket, peer: tuple[str, int]) -> None:
        raw = c.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, ip = struct.unpack_from("!H4s", raw, 2)
        obs.tcp.append((peer[0], socket.inet_ntoa(ip), port))
        c.sendall(b"GW\n")

    def on_dns_udp(s: socket.socket, peer: tuple[str, int], data: bytes) -> None:
        obs.dns.append((peer[0], "udp"))
        s.sendto(data[:2] + b"LAB-DNS", peer)

    def on_dns_tcp(c: socket.socket, peer: tuple[str, int]) -> None:
        obs.dns.append((peer[0], "tcp"))
        c.sendall(b"\x00\x09LAB-DNS!!")

    def on_broker(c: socket.socket, peer: tuple[str, int]) -> None:
        obs.broker.append(peer[0])
        with contextlib.suppress(OSError):
            c.recv(4096)
        task = breg.by_address(peer[0])
        body = (task.task_id if task else "unknown").encode()
        c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def on_trap(c: socket.socket, peer: tuple[str, int]) -> None:
        obs.trap.append(peer[0])

    srv.start(socks["tp"], on_tcp)
    srv.start(dns_udp, on_dns_udp)
    srv.start(dns_tcp, on_dns_tcp)
    srv.start(socks["broker"], on_broker)
    srv.start(socks["trap"], on_trap)
    launcher = Launcher(cfg)
    ruleset = types.SimpleNamespace(profiles=profiles(), version="lab-1")
    try:
        launcher.start()
        yield Lab(launcher, cfg, ruleset, obs, greg, breg, tmp, ports["trap"])
    finally:
        launcher.close()
        launcher.reconcile()
        subprocess.run(["nft", "delete", "table", "inet", cfg.launcher.nft_table],
                       capture_output=True, check=False)
        remove_parent(cfg.launcher.cgroup_root, cfg.launcher.cgroup_parent)
        srv.close()
        for r in runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        lt.join(timeout=5)


@pytest.fixture
def scratch_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A sandbox's scratch as the launcher makes it: a tmpfs of its own (the files API
    refuses a root that is not a mount), unmounted after the test."""
    root = tmp_path / "scratch"
    root.mkdir()
    mounts.mount_tmpfs(str(root), 16 << 20, os.getuid(), os.getgid(), 0o755)
    try:
        yield root
    finally:
        mounts.umount(str(root))
