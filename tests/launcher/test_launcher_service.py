"""The launcher's control service (`stockade launcher serve`) over its real Unix socket.

The service runs as a real subprocess with its own nft table, names, cgroup parent,
address pool and NFLOG group; the `lab` fixture's gateway and broker control servers
(real `make_control_app` on temp sockets) and its broker-port listener stand in for the
gateway and broker, so registration is observable. `LauncherClient` is the client.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from polling import eventually
from stockade.launcher import SandboxSpec, netns
from stockade.launcher.cgroups import remove_parent
from stockade.launcher.service import (
    LauncherClient,
    RequestError,
    parse_run_request,
    run_request,
)

from stockade.config import Config
from stockade.events import validate
from stockade.tasks import ControlError

from .conftest import Lab, command_running
from .sessions_rig import own_config
from .test_launcher_flood import _attempts_in

pytestmark = pytest.mark.netns

PROFILE = """\
profile: {name}
description: launcher service test
limits: {{cpus: 1, memory: 128MiB, disk: 16MiB, pids: 64, ttl: 60s}}
egress:
  mode: enforce
exports: {{max_file: 1KiB, max_total: 4KiB, types: [text]}}
"""

WHOAMI = ("import os, urllib.request\n"
          "print(urllib.request.urlopen(os.environ['STOCKADE_BROKER'] + '/v1/whoami',"
          " timeout=5).read().decode())\n")


@dataclass
class Served:
    config: Config
    cfg_path: Path
    rules: Path
    proc: subprocess.Popen[bytes]
    err: Path

    @property
    def client(self) -> LauncherClient:
        return LauncherClient(self.config.launcher.control_socket, timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _serve(lab: Lab, tmp: Path) -> Iterator[Served]:
    """`stockade launcher serve` on a config of its own that shares the lab's gateway and
    broker; torn down (and checked for leftovers by the tests) at the end."""
    config = own_config(
        lab, tmp, "sv", 216, 7500,
        {"svc": PROFILE.format(name="svc"),
         "gv": PROFILE.format(name="gv") + "isolation: gvisor\n"},
        reconcile_interval_s=1.0,  # orphans of a killed `stockade run` go within 1 s
        # the gv profile stands for a tier this service cannot give
        gvisor=lab.config.launcher.gvisor.model_copy(update={"enabled": False}))
    launcher, rules = config.launcher, Path(config.rules_dir)
    cfg_path = tmp / "stockade.yaml"
    cfg_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    err = tmp / "serve.err"
    with open(err, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "stockade", "launcher", "serve",
                                 "--config", str(cfg_path)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=fh)
    served = Served(config, cfg_path, rules, proc, err)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, err.read_text()
            try:
                return bool(served.client.health()["ok"])
            except OSError:
                return False

        assert eventually(healthy, 60), err.read_text()
        yield served
    finally:
        served.stop()
        # only if the service failed to clean up: never leave the test's pieces behind
        subprocess.run(["nft", "delete", "table", "inet", launcher.nft_table],
                       capture_output=True, check=False)
        remove_parent(launcher.cgroup_root, launcher.cgroup_parent)


@pytest.fixture(scope="module")
def served(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(lab, tmp_path_factory.mktemp("svc"))


@pytest.fixture
def served_once(lab: Lab, tmp_path: Path) -> Iterator[Served]:
    yield from _serve(lab, tmp_path)


# -- the request format (pure) ---------------------------------------------------------------
def test_request_round_trip() -> None:
    spec = SandboxSpec("svc", ["sh", "-c", "cat", ""], inputs=[("/etc/hostname", "/in/h")],
                       export_dir="/tmp/out", ttl=9, env={"A_B": "x"}, stdin=b"text")
    assert parse_run_request(json.loads(json.dumps(run_request(spec, wait=False))),
                             {"svc"}) == (spec, False)
    assert parse_run_request({"profile": "p", "argv": ["true"], "inputs": ["/data/x/"]})[0] \
        .inputs == [("/data/x/", "/inputs/x")]


@pytest.mark.parametrize(("body", "field"), [
    ([], "body"),
    ({"argv": ["true"]}, "profile"),
    ({"profile": "nope", "argv": ["true"]}, "profile"),
    ({"profile": "svc"}, "argv"),
    ({"profile": "svc", "argv": []}, "argv"),
    ({"profile": "svc", "argv": "true"}, "argv"),
    ({"profile": "svc", "argv": ["true", 1]}, "argv[1]"),
    ({"profile": "svc", "argv": ["tr\0ue"]}, "argv[0]"),
    ({"profile": "svc", "argv": ["true"], "ttl": 0}, "ttl"),
    ({"profile": "svc", "argv": ["true"], "ttl": True}, "ttl"),
    ({"profile": "svc", "argv": ["true"], "ttl": "5"}, "ttl"),
    ({"profile": "svc", "argv": ["true"], "env": {"STOCKADE_X": "1"}}, "env"),
    ({"profile": "svc", "argv": ["true"], "env": {"A-B": "1"}}, "env"),
    # a "$" anchor would have let a trailing newline through
    ({"profile": "svc", "argv": ["true"], "env": {"A\n": "1"}}, "env"),
    ({"profile": "svc", "argv": ["true"], "env": {"A": 1}}, "env.A"),
    ({"profile": "svc", "argv": ["true"], "env": ["A=1"]}, "env"),
    ({"profile": "svc", "argv": ["true"], "inputs": ["relative/path"]}, "inputs[0]"),
    ({"profile": "svc", "argv": ["true"], "inputs": [["/etc", "/scratch/x"]]}, "inputs[0]"),
    ({"profile": "svc", "argv": ["true"], "inputs": [["/etc"]]}, "inputs[0]"),
    ({"profile": "svc", "argv": ["true"], "inputs": "/etc"}, "inputs"),
    ({"profile": "svc", "argv": ["true"], "export_dir": "out"}, "export_dir"),
    ({"profile": "svc", "argv": ["true"], "stdin": [1]}, "stdin"),
    ({"profile": "svc", "argv": ["true"], "wait": "no"}, "wait"),
    ({"profile": "svc", "argv": ["true"], "command": "x"}, "command"),
])
def test_request_refusals(body: Any, field: str) -> None:
    with pytest.raises(RequestError) as e:
        parse_run_request(body, {"svc"})
    assert e.value.field == field


# -- over the socket -------------------------------------------------------------------------
def test_socket_is_root_only(served: Served) -> None:
    assert os.stat(served.config.launcher.control_socket).st_mode & 0o777 == 0o600


def test_run_through_the_service(served: Served, lab: Lab, tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("input-data")
    out = tmp_path / "exported"
    res = served.client.run(SandboxSpec(
        "svc", ["sh", "-c", f"cat /in/d; echo; python3 -c \"{WHOAMI}\"; "
                "echo note > /scratch/out/n.txt; cat; echo warn >&2; exit 3"],
        inputs=[(str(data), "/in/d")], export_dir=str(out), stdin=b"piped"))
    lines = res.stdout.splitlines()
    assert res.exit_code == 3 and res.ended_by == "exit", res.stderr
    # registered with the (lab's) broker under its own task id while it ran
    assert lines == ["input-data", res.task_id, "piped"], res.stdout
    assert res.stderr == "warn\n"
    assert [e.name for e in res.exports] == ["n.txt"] and (out / "n.txt").read_text() == "note\n"
    for ev in res.denials:
        validate(ev)
    # deregistered and torn down
    assert lab.broker_registry.get(res.task_id) is None
    assert served.client.list() == []
    assert served.client.result(res.task_id) == res


def test_list_suspend_resume_kill_while_running(served: Served) -> None:
    c = served.client
    tid = c.start(SandboxSpec("svc", ["sleep", "60"]))
    rows = eventually(lambda: [r for r in c.list() if r["task_id"] == tid
                               and r["state"] == "running"], 30)
    assert rows and rows[0]["profile"] == "svc", c.list()
    # "running" is the record; wait for the command itself, so the freeze below never
    # lands inside the sandbox's own set-up (unshare, mounts)
    assert eventually(lambda: command_running(tid, "sleep"), 30)
    assert c.result(tid) is None  # still running
    assert c.health()["sandboxes"] == 1
    assert c.suspend(tid)
    assert [r["state"] for r in c.list() if r["task_id"] == tid] == ["frozen"]
    assert c.resume(tid)
    assert [r["state"] for r in c.list() if r["task_id"] == tid] == ["running"]
    assert c.kill(tid)
    res = eventually(lambda: c.result(tid), 30)
    assert res is not None and res.ended_by == "killed" and res.exit_code == 137
    assert c.list() == []
    assert not c.kill(tid) and not c.suspend(tid) and not c.resume(tid)


def _raw(path: str, request: bytes) -> tuple[int, dict[str, Any]]:
    """One raw HTTP exchange (bodies no well-behaved client would send)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_invalid_requests(served: Served) -> None:
    c = served.client
    for body, field in (({"profile": "nope", "argv": ["true"]}, "profile"),
                        ({"profile": "gv", "argv": ["true"]}, "profile"),  # isolation tier
                        ({"profile": "svc", "argv": []}, "argv"),
                        ({"profile": "svc", "argv": ["true"], "ttl": -1}, "ttl"),
                        ({"profile": "svc", "argv": ["true"], "inputs": ["/nonexistent/x"]},
                         "inputs[0]"),
                        ({"profile": "svc", "argv": ["true"], "extra": 1}, "extra")):
        with pytest.raises(ControlError) as e:
            c._call("POST", "/v1/sandboxes", body)
        assert e.value.status == 400 and e.value.body["field"] == field, e.value.body
        assert e.value.body["error"] == "bad_request" and e.value.body["detail"]
    with pytest.raises(ControlError) as e:
        c._call("POST", "/v1/sandboxes", {"profile": "gv", "argv": ["true"]})
    assert "launcher.downgrade_isolation" in e.value.body["detail"]
    status, body = _raw(served.config.launcher.control_socket,
                        b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 5\r\nConnection: close\r\n\r\n"
                        b"{nope")
    assert (status, body["field"]) == (400, "body")
    for method, path in (("DELETE", "/v1/sandboxes/NOT-AN-ID"),
                         ("POST", "/v1/sandboxes/../../x/suspend"),
                         ("GET", "/v1/sandboxes/zzzzzzzzzz/result")):
        with pytest.raises(ControlError) as e:
            c._call(method, path)
        assert e.value.status in (400, 404), (path, e.value.body)
    for method, path in (("DELETE", "/v1/sandboxes/0123456789"),
                         ("POST", "/v1/sandboxes/0123456789/suspend"),
                         ("POST", "/v1/sandboxes/0123456789/resume"),
                         ("GET", "/v1/sandboxes/0123456789/result")):
        with pytest.raises(ControlError) as e:
            c._call(method, path)
        assert (e.value.status, e.value.body["error"]) == (404, "not_found"), path
    assert c.list() == []


def test_reload_keeps_old_rules_when_invalid(served: Served) -> None:
    c = served.client
    before = c.health()["rules"]
    bad = served.rules / "profiles" / "broken.yaml"
    bad.write_text("profile: broken\nlimits: [not, a, mapping\n")
    try:
        with pytest.raises(ControlError) as e:
            c.reload()
        assert e.value.status == 422 and e.value.body["version"] == before
        assert c.health()["rules"] == before
    finally:
        bad.unlink()
    # SIGHUP picks up a new profile, as with the gateway and the broker
    (served.rules / "profiles" / "svc2.yaml").write_text(PROFILE.format(name="svc2"))
    served.proc.send_signal(signal.SIGHUP)
    assert eventually(lambda: c.health()["rules"] != before, 30), served.err.read_text()
    assert c.run(SandboxSpec("svc2", ["true"])).exit_code == 0


def test_sigterm_kills_sandboxes_and_removes_the_table(served_once: Served, lab: Lab) -> None:
    s = served_once.config.launcher
    c = served_once.client
    tid = c.start(SandboxSpec("svc", ["sleep", "60"]))
    assert lab.gateway_registry.get(tid) is not None
    assert served_once.stop() == 0, served_once.err.read_text()
    assert subprocess.run(["nft", "list", "table", "inet", s.nft_table],
                          capture_output=True, check=False).returncode != 0
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=False).stdout
    assert f"{s.name_prefix}-{tid}" not in netns
    assert lab.gateway_registry.get(tid) is None and lab.broker_registry.get(tid) is None
    assert not os.path.exists(s.control_socket)
    assert not os.listdir(s.scratch_dir)


def _run_in_background(served: Served, argv: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """`stockade run` of `argv` as its own process on the service's launcher config (same
    state file and table): the process and its sandbox's task id, once running."""
    known = {r["task_id"] for r in served.client.list()}
    proc = subprocess.Popen([sys.executable, "-m", "stockade", "run", "--profile", "svc",
                             "--rules", str(served.rules), "--config", str(served.cfg_path),
                             "--", *argv],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    rows = eventually(lambda: [r for r in served.client.list()
                               if r["task_id"] not in known and r["state"] == "running"], 60)
    assert rows, "the run's sandbox did not start"
    assert rows[0]["owner_pid"] == proc.pid
    return proc, rows[0]["task_id"]


def _ends(lab: Lab, task_id: str) -> list[dict[str, Any]]:
    return [e for e in lab.events(task_id) if e["stockade"].get("lifecycle") == "end"]


def _gone(served: Served, lab: Lab, task_id: str) -> bool:
    s = served.config.launcher
    return (all(r["task_id"] != task_id for r in served.client.list())
            and not any(task_id in n for n in netns.list_netns(s.name_prefix))
            and not (Path(s.scratch_dir) / task_id).exists()
            and lab.gateway_registry.get(task_id) is None
            and lab.broker_registry.get(task_id) is None)


def test_a_killed_run_is_reconciled_by_the_service(served: Served, lab: Lab) -> None:
    """SIGKILL a `stockade run`: the running service removes its sandbox within its
    reconcile period (1 s here; the test waits up to 30 s), with one end event."""
    proc, tid = _run_in_background(served, ["sleep", "300"])
    proc.kill()
    proc.wait()
    assert eventually(lambda: _gone(served, lab, tid), 30), served.client.list()
    time.sleep(2.5)  # two more reconcile rounds: still one end event
    ends = _ends(lab, tid)
    assert len(ends) == 1, ends
    assert ends[0]["stockade"]["ended_by"] == "orphaned"
    assert ends[0]["event"]["duration"] > 0
    starts = [e for e in lab.events(tid) if e["stockade"].get("lifecycle") == "start"]
    assert len(starts) == 1


def test_kill_and_reconcile_race_on_an_orphan_give_one_end_event(
    served: Served, lab: Lab
) -> None:
    """A kill and two reconciles (two more launcher processes' worth, and the service's
    own) at once on one orphan: exactly one of them writes its end event."""
    from stockade.launcher import Launcher

    proc, tid = _run_in_background(served, ["sleep", "300"])
    proc.kill()
    proc.wait()
    others = [Launcher(served.config, nflog=False) for _ in range(3)]
    go = threading.Barrier(3)

    def race(i: int) -> None:
        go.wait()
        if i == 0:
            others[i].kill(tid)
        else:
            others[i].reconcile()

    threads = [threading.Thread(target=race, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for o in others:
            o.close()
    assert eventually(lambda: _gone(served, lab, tid), 30)
    time.sleep(2.5)  # the service's reconcile had its rounds too
    ends = _ends(lab, tid)
    assert len(ends) == 1, ends
    assert ends[0]["stockade"]["ended_by"] in ("killed", "orphaned")


def test_a_run_that_ends_itself_has_one_end_event(served: Served, lab: Lab) -> None:
    """The service's reconcile never touches a live run's sandbox: the run ends it, with
    its own end event (exit), and nobody adds another."""
    p = subprocess.run([sys.executable, "-m", "stockade", "run", "--profile", "svc", "--rules",
                        str(served.rules), "--config", str(served.cfg_path), "--json", "--",
                        "sh", "-c", "sleep 2.5; echo done"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["stdout"] == "done\n"
    time.sleep(1.5)  # the service's reconcile rounds (1 s): none may add an end event
    ends = _ends(lab, res["task_id"])
    assert [e["stockade"]["ended_by"] for e in ends] == ["exit"]


BLOCKED_UDP = r"""
import os, socket, sys, time
gw = os.environ["STOCKADE_BROKER"].split("//")[1].split(":")[0]  # host side of the veth
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[1])):
    s.sendto(b"x", (gw, 1000 + i))
time.sleep(300)
"""


def test_a_run_beside_the_service_reports_what_the_service_logged(
    served: Served, lab: Lab
) -> None:
    """The service holds the NFLOG group, so a `stockade run` beside it reads no records:
    its end event's logged count is the bypass events the service wrote to the task's
    store, not zero."""
    script = BLOCKED_UDP.replace("time.sleep(300)", "time.sleep(1.5)")
    p = subprocess.run([sys.executable, "-m", "stockade", "run", "--profile", "svc", "--rules",
                        str(served.rules), "--config", str(served.cfg_path), "--json", "--",
                        "python3", "-c", script, "30"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    tid = json.loads(p.stdout)["task_id"]
    (end,) = _ends(lab, tid)
    bypass = end["stockade"]["bypass"]
    assert bypass["attempts"] >= 30
    assert 1 <= bypass["logged"] <= bypass["attempts"]
    assert bypass["logged"] + bypass["unlogged"] == bypass["attempts"]
    assert len(lab.bypass(tid)) <= bypass["logged"]


@pytest.mark.parametrize("remover", ["reconcile", "kill"])
def test_an_orphans_end_event_counts_its_bypass_attempts(
    served: Served, lab: Lab, remover: str
) -> None:
    """The end event a reconcile or a kill from another process writes for a killed
    run's sandbox carries the nft bypass counter, and every counted attempt is in an
    event or a summary, as for a run that ends itself."""
    from stockade.launcher import Launcher

    from stockade.events.taskstore import read_task_events

    n = 300
    proc, tid = _run_in_background(served, ["python3", "-c", BLOCKED_UDP, str(n)])
    assert eventually(lambda: lab.bypass(tid), 30)
    time.sleep(1.0)  # the rest of the burst: a few hundred sends take milliseconds
    if remover == "kill":
        proc.send_signal(signal.SIGSTOP)  # its owner alive but stuck: the kill removes it
        other = Launcher(served.config, nflog=False)
        try:
            assert other.kill(tid)
        finally:
            other.close()
        proc.kill()
    else:
        proc.kill()
    proc.wait()
    assert eventually(lambda: _gone(served, lab, tid), 30)
    time.sleep(2.5)  # more reconcile rounds: still one end event
    ends = _ends(lab, tid)
    assert len(ends) == 1, ends
    assert ends[0]["stockade"]["ended_by"] == ("killed" if remover == "kill" else "orphaned")
    bypass = ends[0]["stockade"]["bypass"]
    assert bypass["attempts"] >= n
    assert bypass["logged"] + bypass["unlogged"] == bypass["attempts"]
    stored = read_task_events(lab.config.task_events_dir, tid)
    for e in stored:
        validate(e)
    assert _attempts_in(stored) == bypass["attempts"]
    if remover == "reconcile":  # the service read the records and removed the sandbox
        assert ends[0]["stockade"]["event_totals"]["launcher"]["written"] >= 1
