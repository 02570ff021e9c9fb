"""`stockade rules learn` over runs recorded in report mode by the product's EventWriter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stockade.broker.audit import CallLog, audit_event
from stockade.policy import load_rules
from stockade.policy.learn import path_glob

from stockade.cli import main
from stockade.events import EventWriter, make_event
from stockade.tasks import Task

API = """
api: demo-api
base_url: https://api.test
credential: {mount: secret, path: stockade/demo-api, field: token}
inject: {style: bearer}
"""


def conn(task: str, host: str | None, port: int = 443, ip: str | None = None,
         allowed: bool = True) -> dict:
    # report mode: the rules deny, the gateway lets the flow through and says so
    return make_event(component="gateway", action="connection_decision",
                      decision="allowed" if allowed else "denied", reason="no_matching_rule",
                      task_id=task, profile="job", report_only=allowed,
                      destination_domain=host, destination_ip=ip, destination_port=port,
                      transport="tcp")  # fmt: skip


def request(task: str, host: str, method: str, path: str) -> dict:
    # as the inspector's addon writes it (gateway/inspector/addon.py _request_event)
    return make_event(component="gateway", action="request_decision", decision="allowed",
                      reason="no_matching_rule", task_id=task, profile="job",
                      report_only=True, protocol="http", http_method=method,
                      url={"scheme": "https", "domain": host, "port": 443, "path": path},
                      extra={"http_version": "HTTP/1.1"})  # fmt: skip


def call(task: str, path: str) -> dict:
    cl = CallLog(t0=0.0, source_ip="10.0.0.2", task=Task(task, "10.0.0.2", "job"),
                 api="demo-api", method="GET", path=path, status=200, decision="allowed",
                 reason="allowed")  # fmt: skip
    return audit_event(cl, "v", "demo-api", latency_ms=1.0)


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    """Three runs of one job; run r3 also fetched an odd host and path. Small files, so
    the writer rotates them."""
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, max_bytes=3000, backups=9)
    for task in ("r1", "r2", "r3"):
        w.write(conn(task, "pkgs.example.test"))
        w.write(request(task, "pkgs.example.test", "GET", "/simple/requests/"))
        w.write(request(task, "pkgs.example.test", "get", "/simple/idna/"))
        w.write(conn(task, None, port=5432, ip="192.0.2.7"))
        w.write(call(task, "/v1/items"))
    w.write(conn("r3", "odd.example.test"))
    w.write(request("r3", "pkgs.example.test", "POST", "/upload/x"))
    w.write(conn("r2", "evil.example.test", allowed=False))  # enforce-mode denial
    w.write(conn("other", "elsewhere.test"))  # another task, not asked for
    w.close()
    assert (tmp_path / "events.jsonl.1").exists()
    return path


GOLDEN = """\
# proposed by `stockade rules learn` from 3 task(s) (kept: needed by at least 1 of them): r1, r2, r3
# fill in every 'reason: TODO' (why the task needs it) or remove the entry
profile: "job"
description: TODO
egress:
  mode: enforce
  allow:
    # evidence: 3 event(s) in 3 of 3 task(s)
    - cidr: "192.0.2.7/32"
      ports: [5432]
      reason: TODO
    # evidence: 3 event(s) in 3 of 3 task(s)
    - host: "pkgs.example.test"
      ports: [443]
      reason: TODO
      http: {methods: ["GET"], paths: ["/simple/**"]}
broker:
  apis:
    "demo-api":
      operations:
        - {method: "GET", path: "/v1/items"}  # evidence: 3 event(s) in 3 of 3 task(s)
# not proposed (too few tasks): odd.example.test:443 (1 of 3 tasks)
# not proposed (too few tasks): POST pkgs.example.test/upload/** (1 of 3 tasks)
# denied while recorded, not proposed: evil.example.test (1 event(s))
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["rules", "learn", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_path_glob():
    assert path_glob("/simple/requests/") == "/simple/**"
    assert path_glob("/") == "/" and path_glob("/x?y=1") == "/x/**"


def test_learn_golden_and_loadable(capsys, recorded, write_rules):
    tasks = ("--task", "r1", "--task", "r2", "--task", "r3")
    rc, out, err = run(capsys, "--events", str(recorded), *tasks, "--name", "job")
    assert rc == 0 and out == GOLDEN, err
    rs = load_rules(write_rules(profiles={"job": out}, apis={"demo-api": API}))
    entries = {e.host or str(e.cidr): e for e in rs.profiles["job"].allow}
    assert entries["pkgs.example.test"].http.methods == frozenset({"GET"})
    assert entries["192.0.2.7/32"].ports == frozenset({5432})


def test_learn_min_share_keeps_what_most_needed(capsys, recorded):
    rc, out, _ = run(capsys, "--events", str(recorded), "--profile", "job",
                     "--min-share", "0.25", "--json")  # fmt: skip
    data = json.loads(out)
    # --profile takes every task of it, "other" included: 4 tasks, 0.25 = one of them
    assert rc == 0 and data["tasks"] == ["other", "r1", "r2", "r3"]
    hosts = {e["target"]: e for e in data["allow"]}
    assert {"odd.example.test", "elsewhere.test", "pkgs.example.test"} <= set(hosts)
    assert hosts["pkgs.example.test"]["methods"] == ["GET", "POST"]
    assert hosts["pkgs.example.test"]["evidence"]["task_ids"] == ["r1", "r2", "r3"]


def test_learn_bad_input(capsys, recorded, tmp_path):
    assert run(capsys, "--events", str(recorded))[0] == 2  # no task, no profile
    rc, _, err = run(capsys, "--events", str(recorded), "--task", "nope")
    assert rc == 2 and "no decisions of those tasks" in err
    rc, _, err = run(capsys, "--events", str(tmp_path / "none"), "--task", "r1")
    assert rc == 2 and "no events file" in err
    with pytest.raises(SystemExit):
        run(capsys, "--events", str(recorded), "--task", "r1", "--min-share", "0")


def test_learn_run_options_need_a_command(capsys, recorded):
    for argv, message in (
        (("--profile", "job", "--"), "missing command after --"),
        (("--profile", "job", "--runs", "2"), "--runs and --input are for a task learn runs"),
        (("--profile", "job", "--input", "/etc/hosts"), "--runs and --input are for a task"),
    ):
        rc, out, err = run(capsys, "--events", str(recorded), *argv)
        assert (rc, out) == (2, "") and message in err, (argv, err)
