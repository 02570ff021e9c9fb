"""The units' premises, checked on the real services: the gateway and the broker run with the
example config as an unprivileged user with an empty capability bounding set and
no_new_privs (what stockade-*.service grant them), serve the metrics the alert rules use on
the endpoints Prometheus scrapes, and reload their rules on SIGHUP (ExecReload=).

Needs root (to drop to uid 65534 with setpriv). Vault is not running: the broker starts
anyway and serves; nothing here needs a secret."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import (
    EXAMPLE_CONFIG,
    REPO,
    UNITS,
    parse_unit,
    rule_exprs,
    selectors,
    source_metrics,
    traced_syscalls,
    unit_syscall_allowlist,
)
from dnslib import DNSRecord

from stockade.events import read_events, validate
from stockade.ports import free_port

NOBODY = 65534
STRACE = shutil.which("strace")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv (util-linux) to run the services as an unprivileged user",
)


def _wait(what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll until `check` holds; fail early if the service died (60 s is a hang guard)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what}: exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            if check():
                return
        time.sleep(0.1)
    pytest.fail(f"{what}: not ready:\n{log.read_text()[-3000:]}")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


class Stack:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.cfg: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports = {
            k: free_port() for k in ("gw_metrics", "br_metrics", "broker", "gw_t", "proxy", "dns")
        }
        c, r = self.cfg, str(root)
        # the example config with this host's paths and free loopback ports; the rest as shipped
        c.update(
            rules_dir=str(REPO / "rules"),
            state_dir=f"{r}/lib",
            log_dir=f"{r}/log",
            run_dir=f"{r}/run",
        )
        c["events"]["file"] = f"{r}/log/events.jsonl"
        c["gateway"].update(
            transparent_listen=[f"127.0.0.1:{self.ports['gw_t']}"],
            proxy_listen=[f"127.0.0.1:{self.ports['proxy']}"],
            control_socket=f"{r}/run/gateway.sock",
            metrics_listen=f"127.0.0.1:{self.ports['gw_metrics']}",
            registry_file=f"{r}/lib/gateway/tasks.json",
        )
        c["dns"]["listen"] = [f"127.0.0.1:{self.ports['dns']}"]
        c["broker"].update(
            listen=f"127.0.0.1:{self.ports['broker']}",
            control_socket=f"{r}/run/broker.sock",
            metrics_listen=f"127.0.0.1:{self.ports['br_metrics']}",
            state_file=f"{r}/lib/broker/tasks.json",
        )
        creds = root / "credentials"
        creds.mkdir()
        for name in ("vault-role-id", "vault-secret-id"):
            (creds / name).write_text("not-a-real-id\n")
        c["vault"]["address"] = f"http://127.0.0.1:{free_port()}"  # nothing listens
        c["vault"]["approle"].update(
            role_id_file=str(creds / "vault-role-id"),
            secret_id_file=str(creds / "vault-secret-id"),
        )
        self.config_file = root / "stockade.yaml"
        self.config_file.write_text(yaml.safe_dump(c))
        # what the units' *Directory= lines create, owned by the service user
        for d in ("lib/gateway", "lib/broker", "log", "run"):
            (root / d).mkdir(parents=True)
        for p in [root, *root.rglob("*")]:
            os.chown(p, NOBODY, NOBODY)

    def start(self, component: str, *extra: str) -> None:
        log = self.root / f"{component}.out"
        # under strace (when installed), to check the syscalls against the units' filters
        trace = ["strace", "-f", "-qq", "-o", str(self.trace(component))] if STRACE else []
        argv = [*trace,
            "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
            str(Path(sys.executable).parent / "stockade"), component, "serve",
            "--config", str(self.config_file), *extra,
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.procs[component] = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd="/", start_new_session=True
            )

    def log(self, component: str) -> Path:
        return self.root / f"{component}.out"

    def trace(self, component: str) -> Path:
        return self.root / f"{component}.strace"

    def pid(self, component: str) -> int:
        """The service's pid (under strace: the tracer's child, setpriv exec'd into it)."""
        pid = self.procs[component].pid
        if not STRACE:
            return pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert len(children) == 1, children
        return int(children[0])

    def signal(self, component: str, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, AssertionError):
            os.kill(self.pid(component), sig)

    def stop(self) -> None:
        for component, proc in self.procs.items():
            if proc.poll() is None:
                self.signal(component, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _nobody_can_run_the_checkout() -> str | None:
    """Why uid 65534 cannot run this checkout's CLI and read its rules (None: it can)."""
    probe = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         str(Path(sys.executable).parent / "stockade"), "rules", "lint", str(REPO / "rules")],
        capture_output=True, text=True, check=False, cwd="/",
    )  # fmt: skip
    return None if probe.returncode == 0 else (probe.stderr or probe.stdout)[-500:]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    why = _nobody_can_run_the_checkout()
    if why is not None:
        pytest.skip(f"uid {NOBODY} cannot run this checkout (directory permissions?): {why}")
    root = Path(tempfile.mkdtemp(prefix="stockade-deploy-"))
    s = Stack(root)
    try:
        s.start("gateway", "--log-level", "INFO")
        s.start("broker")
        _wait(
            "gateway",
            lambda: bool(_scrape(s.ports["gw_metrics"])),
            s.procs["gateway"],
            s.log("gateway"),
        )
        _wait(
            "broker",
            lambda: bool(_scrape(s.ports["br_metrics"])),
            s.procs["broker"],
            s.log("broker"),
        )
        yield s
    finally:
        s.stop()
        shutil.rmtree(root, ignore_errors=True)


def _families(exposition: str) -> set[str]:
    """Metric families (constructor names) with a line in a text exposition."""
    by_series = {s: m.name for m in source_metrics().values() for s in m.samples()}
    out = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
        elif line and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
        else:
            continue
        out.add(by_series.get(name, name))
    return out


@pytest.mark.parametrize(
    ("job", "port"), [("stockade-gateway", "gw_metrics"), ("stockade-broker", "br_metrics")]
)
def test_each_job_serves_the_metrics_its_rules_query(stack: Stack, job: str, port: str) -> None:
    """Families appear once they have a sample: one denied connection / call makes the
    labelled decision counters appear, the rest are unlabelled."""
    if job == "stockade-gateway":
        query = DNSRecord.question("example.org", "A")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.settimeout(10)
            u.sendto(query.pack(), ("127.0.0.1", stack.ports["dns"]))
            assert DNSRecord.parse(u.recv(4096)).header.rcode != 0  # refused: no task
        with socket.create_connection(("127.0.0.1", stack.ports["gw_t"]), timeout=10) as c:
            c.sendall(b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n")
            c.settimeout(10)
            with contextlib.suppress(OSError):
                c.recv(4096)  # denied: 127.0.0.1 is no registered task
    else:
        req = urllib.request.Request(
            f"http://127.0.0.1:{stack.ports['broker']}/v1/call", data=b"{}", method="POST"
        )
        with contextlib.suppress(OSError):
            urllib.request.urlopen(req, timeout=10).close()
    served = _families(_scrape(stack.ports[port]))
    defs = source_metrics()
    assert served <= set(defs), f"{job} serves metrics the code scan did not find"
    prefix = {
        "stockade-gateway": ("stockade_gateway_", "stockade_dns_"),
        "stockade-broker": ("stockade_broker_",),
    }[job]
    wanted = set()
    for _name, expr in rule_exprs():
        for sel in selectors(expr):
            for fam in defs.values():
                if (
                    fam.name.startswith(prefix)
                    and sel.metric in fam.samples()
                    and (not fam.labels or fam.name.endswith(("_decisions", "_calls")))
                ):
                    wanted.add(fam.name)
    assert wanted, job
    assert wanted <= served, f"{job} does not serve {wanted - served}"


def test_runs_without_privileges(stack: Stack) -> None:
    for component in stack.procs:
        status = Path(f"/proc/{stack.pid(component)}/status").read_text()
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        assert fields["Uid"].split()[0] == str(NOBODY), component
        assert int(fields["CapBnd"], 16) == 0 and int(fields["CapEff"], 16) == 0, component
        assert fields["NoNewPrivs"].strip() == "1", component
    sockets = [stack.root / "run" / "gateway.sock", stack.root / "run" / "broker.sock"]
    for sock in sockets:
        st = sock.stat()
        assert st.st_uid == NOBODY and st.st_mode & 0o077 == 0, sock


def test_sighup_reloads_the_rules(stack: Stack) -> None:
    """What `systemctl reload` (ExecReload=/bin/kill -HUP $MAINPID) does."""
    events_file = Path(stack.cfg["events"]["file"])

    def reloads() -> dict[str, int]:
        out = {"gateway": 0, "broker": 0}
        for ev in read_events(events_file):
            if ev["event"]["action"] == "rules_reload" and ev["event"].get("outcome") == "success":
                comp = "broker" if ev["stockade"]["component"] == "broker" else "gateway"
                out[comp] += 1
        return out

    before = reloads()
    for component in ("gateway", "broker"):
        stack.signal(component, signal.SIGHUP)
    for component in ("gateway", "broker"):
        _wait(
            f"{component} reload",
            lambda c=component: reloads()[c] > before[c],
            stack.procs[component],
            stack.log(component),
        )
    for component, proc in stack.procs.items():
        assert proc.poll() is None, f"{component} died of SIGHUP"
    for ev in read_events(events_file):
        validate(ev)
    gw = _scrape(stack.ports["gw_metrics"])
    assert 'stockade_gateway_rule_reloads_total{result="success"}' in gw


def test_syscalls_stay_within_the_units_filters(stack: Stack) -> None:
    """Everything the services did in this module (start, connections, DNS, broker call,
    SIGHUP) used only syscalls their unit's SystemCallFilter= allows; a filtered syscall
    would fail with EPERM in production and nowhere else."""
    if not STRACE:
        pytest.skip("strace not installed")
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (expands the @groups)")
    for component in ("gateway", "broker"):
        allowed = unit_syscall_allowlist(parse_unit(UNITS[component]), analyze)
        used = traced_syscalls(stack.trace(component), "bin/stockade")
        assert len(used) > 20, used
        denied = sorted(used - allowed)
        assert not denied, f"{component}: the unit's SystemCallFilter= blocks {denied}"
