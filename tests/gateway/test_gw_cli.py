"""`stockade gateway serve --config FILE` as a real process: control API, DNS firewall in
the same process, reload (SIGHUP, file change, control API) without dropping live
connections, refusal of invalid rules, registry persistence across a restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_harness import connect_tunnel, free_port, gateway_config, write_config
from gw_rules import write_rules
from polling import wait_until

from stockade.config import load_config
from stockade.events import read_events, validate
from stockade.tasks import ControlClient, Task
from stockade.testing.testnet import FakeInternet

pytestmark = pytest.mark.netns

STOCKADE = str(Path(sys.executable).with_name("stockade"))


class Served:
    def __init__(self, cfg: Path) -> None:
        self.cfg = cfg
        self.config = load_config(cfg)
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Served:
        self.proc = subprocess.Popen(
            [STOCKADE, "gateway", "serve", "--config", str(self.cfg)],
            stderr=subprocess.PIPE,
            text=True,
        )
        ctl = self.control
        for _ in range(200):
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited: {self.proc.stderr.read()}")  # type: ignore[union-attr]
            try:
                ctl.health()
                return self
            except OSError:
                time.sleep(0.05)
        raise AssertionError("gateway did not come up")

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)

    @property
    def control(self) -> ControlClient:
        return ControlClient(self.config.gateway.control_socket)

    def events(self, action: str | None = None) -> list[dict[str, Any]]:
        evs = read_events(self.config.events_file)
        for ev in evs:
            validate(ev)
        return [e for e in evs if action is None or e["event"]["action"] == action]

    def wait_event(self, action: str, n: int) -> list[dict[str, Any]]:
        def enough() -> list[dict[str, Any]]:
            evs = self.events(action)
            return evs if len(evs) >= n else []

        return wait_until(enough, 10, 0.1,
                          what=lambda: f"expected {n} {action} events, got {self.events(action)}")


@pytest.fixture
def served(fake_internet: FakeInternet, tmp_path: Path) -> Iterator[Served]:
    rules = write_rules(tmp_path / "rules", cidr=fake_internet.subnet)
    dns_port = free_port()
    cfg = gateway_config(
        tmp_path,
        fake_internet,
        rules,
        dns={"listen": [f"127.0.0.1:{dns_port}"]},
        transparent_listen=[f"127.0.0.1:{free_port()}"],
        proxy_listen=[f"127.0.0.1:{free_port()}"],
        rules_poll_interval_s=0.5,
    )
    s = Served(cfg).start()
    s.dns_port = dns_port  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        if s.proc and s.proc.poll() is None:
            s.stop()


def served_tunnel(s: Served, authority: str) -> socket.socket:
    host, port = s.config.gateway.proxy_listen[0].rsplit(":", 1)
    return connect_tunnel((host, int(port)), authority)


def echo(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_serve_reload_and_restart(served: Served, fake_internet: FakeInternet) -> None:
    ctl = served.control
    assert os.stat(served.config.gateway.control_socket).st_mode & 0o777 == 0o600
    ctl.register(Task("t-cli", "127.0.0.1", "web"))
    v1 = ctl.health()["rules_version"]

    # the DNS firewall runs in the same process, sharing registry and rules
    dig = subprocess.run(
        [
            "dig",
            "+short",
            "+time=5",
            "+tries=1",
            "-p",
            str(served.dns_port),  # type: ignore[attr-defined]
            "@127.0.0.1",
            "allowed.test",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert dig.stdout.strip() == fake_internet.addresses["allowed.test"], dig

    # a live raw-TCP tunnel (cidr rule) to the fake internet's echo server
    echo_ip, echo_port = fake_internet.tcp_echo
    tunnel = served_tunnel(served, f"{echo_ip}:{echo_port}")
    assert echo(tunnel, b"ping-1") == b"ping-1"

    # an invalid rule file: refused on SIGHUP, old rules stay in force
    profile = Path(served.config.rules_dir) / "profiles" / "web.yaml"
    good = profile.read_text()
    profile.write_text(good + "\nthis is: [not valid\n")
    assert served.proc is not None
    served.proc.send_signal(signal.SIGHUP)
    failed = [
        e for e in served.wait_event("rules_reload", 1) if e["stockade"]["decision"] == "denied"
    ]
    assert failed and failed[0]["event"]["reason"] == "rules_invalid"
    assert ctl.health()["rules_version"] == v1
    assert echo(tunnel, b"ping-2") == b"ping-2"

    # a valid change is picked up from the file change alone
    profile.write_text(good.replace("reason: wildcard", "reason: wildcard subdomains"))
    evs = served.wait_event("rules_reload", 2)
    ok = [e for e in evs if e["stockade"]["decision"] == "allowed"]
    assert ok and ok[-1]["stockade"]["trigger"] == "file_change"
    v2 = ctl.health()["rules_version"]
    assert v2 != v1
    # the control API reload reports the version in force
    assert ctl.reload()["version"] == v2
    assert echo(tunnel, b"ping-3") == b"ping-3"  # reloads never dropped the tunnel
    tunnel.close()

    # registrations survive a restart (state dir)
    assert served.stop() == 0
    served.start()
    assert [t.task_id for t in served.control.list()] == ["t-cli"]
    served.control.deregister("t-cli")


def serve_until_exit(cfg: Path) -> subprocess.CompletedProcess[str]:
    """`gateway serve` that is expected to refuse to start."""
    return subprocess.run(
        [STOCKADE, "gateway", "serve", "--no-dns", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_invalid_rules_refuse_to_start(fake_internet: FakeInternet, tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    (rules / "profiles").mkdir(parents=True)
    (rules / "profiles" / "bad.yaml").write_text("profile: bad\negress: {allow: [{host: x}]}\n")
    cfg = write_config(
        tmp_path,
        rules,
        transparent_listen=[f"127.0.0.1:{free_port()}"],
        proxy_listen=[f"127.0.0.1:{free_port()}"],
    )
    r = serve_until_exit(cfg)
    assert r.returncode == 2
    assert r.stderr.startswith("stockade gateway: invalid rules:\n"), r.stderr
    assert "Traceback" not in r.stderr


def test_unusable_listener_or_directory_refuses_to_start(tmp_path: Path) -> None:
    """The same as the broker and the launcher service: exit 2 and a one-line reason."""
    rules = write_rules(tmp_path / "rules", cidr="192.0.2.0/24")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        cfg = write_config(
            tmp_path,
            rules,
            transparent_listen=[f"127.0.0.1:{free_port()}"],
            proxy_listen=[busy],
        )
        r = serve_until_exit(cfg)
    assert (r.returncode, r.stderr.count("\n")) == (2, 1), r.stderr
    assert r.stderr.startswith("stockade gateway: cannot start: [Errno 98]"), r.stderr

    # a log directory that cannot be made (a file stands in its way): the same
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cfg.write_text(cfg.read_text().replace(str(tmp_path / "log"), str(blocker / "log")))
    r = serve_until_exit(cfg)
    assert (r.returncode, r.stderr.count("\n")) == (2, 1), r.stderr
    assert r.stderr.startswith("stockade gateway: cannot start: "), r.stderr
