"""`FakeInternet`: a network namespace full of test hosts, reachable from the host.

Used by every test suite and by `stockade demo`, so it has to work on any Linux machine as
root with no internet: one namespace, one veth to the host, addresses from
`layout.plan`, and one server process (`stockade.testing.testnet.serve`) inside the namespace.
The namespace has no default route: nothing in it can reach anything but the host veth.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stockade.lifecycle import StartStop
from stockade.testing._startup import stop_on_failure
from stockade.testing.testnet import host
from stockade.testing.testnet.gitrepo import create_demo_repo
from stockade.testing.testnet.layout import (
    DEFAULT_SUBNET,
    TCP_ECHO_PORT,
    UDP_ECHO_PORT,
    WILDCARD_SITES,
    Layout,
    pick_subnet,
    plan,
)
from stockade.testing.testnet.spec import ServeSpec, Site
from stockade.testing.testnet.zone import SLOW_DELAY, Record, default_zone

READY_TIMEOUT = 30.0
DEFAULT_API_KEY = "sk-demo-0123456789abcdef"

ExtraRecords = Mapping[str, Iterable[Record | tuple[str, str] | tuple[str, str, int]]]


T = TypeVar("T")


def _started(value: T | None) -> T:
    """`value`, set by `start()`; before that the rig has nothing to say."""
    if value is None:
        raise RuntimeError("FakeInternet not started")
    return value


class FakeInternet(StartStop):
    """Test hosts in a namespace: DNS, HTTP/HTTPS sites, TCP/UDP echo (see docs/testnet.md)."""

    def __init__(
        self,
        subnet: str = DEFAULT_SUBNET,
        *,
        api_key: str = DEFAULT_API_KEY,
        extra_records: ExtraRecords | None = None,
        slow_delay: float = SLOW_DELAY,
        ready_timeout: float = READY_TIMEOUT,
        python: str | None = None,
        name_prefix: str = "skinet",
        projects: int = 1,
    ) -> None:
        if not (name_prefix.isalnum() and name_prefix.islower() and len(name_prefix) <= 8):
            raise ValueError("name_prefix: up to 8 lower-case letters/digits")
        self.requested_subnet = subnet
        self.api_key = api_key
        self._extra_records = extra_records
        self._slow_delay = slow_delay
        self._ready_timeout = ready_timeout
        self._python = python or sys.executable
        self._projects = projects  # pypi.test's demo projects (see wheel.demo_wheels)
        tag = secrets.token_hex(3)
        # a run can tell its own namespace from other runs' by the prefix (the demo: "skfi")
        self.namespace = f"{name_prefix}-{tag}"
        self.host_if = f"{name_prefix}-{tag}"  # host side of the veth (<= 15 chars)
        self.ns_if = "eth0"
        self._layout: Layout | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._tmp: Path | None = None
        self._started = False
        # reentrant: stop() may run again from the SIGTERM handler while stop() holds it
        self._stop_lock = threading.RLock()
        self.ipv6_enabled = False
        self._stopped = False

    # -- attributes (valid after start) ----------------------------------------------

    @property
    def layout(self) -> Layout:
        return _started(self._layout)

    @property
    def subnet(self) -> str:
        return self.layout.subnet

    @property
    def host_ip(self) -> str:
        return self.layout.host_ip

    @property
    def dns_server(self) -> str:
        return self.layout.dns_server

    @property
    def addresses(self) -> dict[str, str]:
        return dict(self.layout.addresses)

    @property
    def raw_echo_ip(self) -> str:
        return self.layout.raw_echo_ip

    @property
    def tcp_echo(self) -> tuple[str, int]:
        return (self.layout.raw_echo_ip, TCP_ECHO_PORT)

    @property
    def udp_echo(self) -> tuple[str, int]:
        return (self.layout.raw_echo_ip, UDP_ECHO_PORT)

    @property
    def ipv6_address(self) -> str:
        return self.layout.ipv6_address

    @property
    def ca_pem(self) -> str:
        return str(self.workdir / "ca.pem")

    @property
    def workdir(self) -> Path:
        return _started(self._tmp)

    @property
    def git_root(self) -> Path:
        """Directory of the bare repositories git.test serves (`demo.git`)."""
        return self.workdir / "git"

    def dns_queries(self) -> list[tuple[str, str]]:
        """(name, qtype) of every query the fake DNS server received so far, in order."""
        try:
            text = (self.workdir / "dns-queries.log").read_text()
        except FileNotFoundError:
            return []
        return [(n, t) for t, _, n in (line.partition(" ") for line in text.splitlines())]

    def resolve_args(self, name: str, port: int = 443) -> list[str]:
        """`curl --resolve` arguments that pin `name` to its fake address."""
        return ["--resolve", f"{name}:{port}:{self.addresses[name]}"]

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> FakeInternet:
        if self._started:
            raise RuntimeError("FakeInternet already started")
        reason = host.available()
        if reason:
            raise host.TestnetError(f"cannot build the fake internet: {reason}")
        self._started = True
        host.register_cleanup(self, self.stop)
        with stop_on_failure(self.stop):
            host.reap_stale()
            self._tmp = Path(tempfile.mkdtemp(prefix=f"{self.namespace}-"))
            self._wire()
            self._write_certs()
            create_demo_repo(self._tmp / "git")
            self._start_server()
        return self

    def _wire(self) -> None:
        ns, hif = self.namespace, self.host_if
        with host.alloc_lock():
            self._layout = lay = plan(pick_subnet(self.requested_subnet, host.used_networks()))
            host.write_owner(ns, ns, [hif], [])
            host.run(["ip", "netns", "add", ns])
            host.run(
                ["ip", "link", "add", hif, "type", "veth", "peer", "name", self.ns_if, "netns", ns]
            )
            host.run(["ip", "addr", "add", f"{lay.host_ip}/{lay.prefixlen}", "dev", hif])
            # IPv6 is optional: a host booted with ipv6.disable=1 still gets an IPv4 internet
            self.ipv6_enabled = Path("/proc/sys/net/ipv6").is_dir()
            if self.ipv6_enabled:
                host.run(["ip", "-6", "addr", "add", f"{lay.host_ip6}/64", "dev", hif, "nodad"])
            host.run(["ip", "link", "set", hif, "up"])
        n = ["ip", "-n", ns]
        host.run([*n, "link", "set", "lo", "up"])
        for ip in lay.ns_ips:
            host.run([*n, "addr", "add", f"{ip}/{lay.prefixlen}", "dev", self.ns_if])
        for ip6 in (lay.ns_ip6, lay.ipv6_address) if self.ipv6_enabled else ():
            host.run([*n, "-6", "addr", "add", f"{ip6}/64", "dev", self.ns_if, "nodad"])
        host.run([*n, "link", "set", self.ns_if, "up"])
        host.write_resolv_conf(ns, lay.dns_server)

    def _write_certs(self) -> None:
        import trustme  # test-CA library; imported here so importing the testnet stays light

        assert self._tmp is not None
        ca = trustme.CA(organization_name="Stockade fake internet")
        ca.cert_pem.write_to_path(str(self._tmp / "ca.pem"))
        for name in [*self.layout.addresses, "ipv6.test"]:
            # these also serve every name under them (see zone.default_zone's answer_all)
            wild = (f"*.{name}",) if name in WILDCARD_SITES else ()
            cert = ca.issue_cert(name, *wild)
            fd = os.open(self._tmp / f"{name}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(cert.private_key_pem.bytes())
            chain = b"".join(b.bytes() for b in cert.cert_chain_pems)
            (self._tmp / f"{name}.pem").write_bytes(chain)

    def _spec(self) -> ServeSpec:
        lay, tmp = self.layout, self.workdir
        sites = [
            Site(name, ip, str(tmp / f"{name}.pem"), str(tmp / f"{name}.key"))
            for name, ip in lay.addresses.items()
        ]
        if self.ipv6_enabled:
            v6 = "ipv6.test"
            sites.append(
                Site(v6, lay.ipv6_address, str(tmp / f"{v6}.pem"), str(tmp / f"{v6}.key"))
            )
        return ServeSpec(
            sites=sites,
            dns_address=lay.dns_server,
            zone=default_zone(lay, self._extra_records, self._slow_delay),
            api_key=self.api_key,
            tcp_echo=(lay.raw_echo_ip, TCP_ECHO_PORT),
            udp_echo=(lay.raw_echo_ip, UDP_ECHO_PORT),
            query_log=str(tmp / "dns-queries.log"),
            git_root=str(tmp / "git"),
            projects=self._projects,
        )

    def _start_server(self) -> None:
        tmp = self.workdir
        spec_path = tmp / "spec.json"
        self._spec().write(spec_path)
        log = open(tmp / "serve.log", "w")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.namespace,
                    self._python,
                    "-m",
                    "stockade.testing.testnet.serve",
                    "--spec",
                    str(spec_path),
                    "--parent-pid",
                    str(os.getpid()),
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + self._ready_timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise host.TestnetError(
                        f"fake internet server not ready after {self._ready_timeout}s: "
                        + self._log_tail()
                    )
                if sel.select(timeout=left):
                    line = self._proc.stdout.readline()
                    if line.strip() == "ready":
                        return
                    if line == "":
                        raise host.TestnetError(
                            f"fake internet server exited ({self._proc.wait()}): "
                            + self._log_tail()
                        )

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "serve.log").read_text()[-2000:]
        return "(no log)"

    def _argv(self, argv: Sequence[str]) -> list[str]:
        if not self.alive():
            raise RuntimeError("FakeInternet not running")
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """`subprocess.run` inside the fake internet's namespace: the "direct" vantage point,
        where names resolve through the fake DNS (resolv.conf) and no gateway is in the way."""
        kw.setdefault("check", False)
        return subprocess.run(self._argv(argv), **kw)

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self._argv(argv), **kw)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Stop the server and remove namespace, veth and temp dir. Idempotent."""
        with self._stop_lock:
            if self._stopped or not self._started:
                return
            self._stopped = True
        try:
            if self._proc is not None:
                if self._proc.poll() is None:
                    self._proc.terminate()
                    try:
                        self._proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        self._proc.kill()
                        self._proc.wait()
                if self._proc.stdout is not None:
                    self._proc.stdout.close()
            host.remove_resources(self.namespace, [self.host_if], [])
            host.drop_owner(self.namespace)
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
            host.unregister_cleanup(self)
