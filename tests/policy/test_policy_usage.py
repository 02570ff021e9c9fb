"""`stockade rules usage` over event files the product's own EventWriter wrote, with
rotations, a schema 1.0 file (old field names) and a torn line."""

from __future__ import annotations

import json
import textwrap
from datetime import UTC, date, datetime
from pathlib import Path

import pytest
from stockade.broker.audit import CallLog, audit_event
from stockade.policy import eventlog as ev
from stockade.policy import load_rules
from stockade.policy.usage import near, usage

from stockade.cli import main
from stockade.events import EventWriter, make_event
from stockade.tasks import Task

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC).timestamp()
DAY = 86400.0
TODAY = date(2026, 12, 1)

PROFILE = """
profile: p
egress:
  allow:
    - {host: pkgs.example.test, id: pkgs, reason: the package index, owner: build-team,
       review_by: 2027-03-01}
    - {host: "*.cdn.example.test", id: cdn, reason: file mirrors}
    - {host: old.example.test, id: old, reason: a mirror nobody uses, review_by: 2026-11-01,
       owner: alice}
    - {host: soon.example.test, id: soon, reason: a trial, expires: 2026-12-05}
  deny:
    - {host: upload.example.test, id: no-upload, reason: no publishing}
broker:
  apis:
    demo-api:
      operations: [{method: GET, path: "/v1/**"}]
"""
API = """
api: demo-api
base_url: https://api.test
credential: {mount: secret, path: stockade/demo-api, field: token}
inject: {style: bearer}
"""


def decision(rule: str | None, host: str, task: str, t: float, allowed: bool = True,
             action: str = "connection_decision") -> dict:
    return make_event(component="gateway", action=action,
                      decision="allowed" if allowed else "denied",
                      reason="allowed" if allowed else "no_matching_rule", task_id=task,
                      profile="p", rule_id=rule, policy_version="v", destination_domain=host,
                      destination_port=443, transport="tcp", now=t)  # fmt: skip


def close(rule: str, host: str, task: str, t: float, up: int, down: int) -> dict:
    # the gateway's connection_close: bytes and duration go through make_event's extra,
    # which moves them to source.bytes / destination.bytes / event.duration
    return make_event(component="gateway", action="connection_close", reason="closed",
                      task_id=task, profile="p", rule_id=rule, destination_domain=host,
                      extra={"bytes_up": up, "bytes_down": down, "duration_s": 1.5},
                      now=t)  # fmt: skip


def broker_call(task: str, t: float) -> dict:
    cl = CallLog(t0=t, source_ip="10.0.0.2", task=Task(task, "10.0.0.2", "p"),
                 api="demo-api", method="GET", path="/v1/items", status=200,
                 bytes_up=10, bytes_down=300, decision="allowed", reason="allowed")  # fmt: skip
    e = audit_event(cl, "v", "demo-api", latency_ms=12.0)
    e["@timestamp"] = make_event(component="broker", action="x", now=t)["@timestamp"]
    return e


@pytest.fixture
def rules(write_rules) -> Path:
    return write_rules(profiles={"p": PROFILE}, apis={"demo-api": API})


@pytest.fixture
def events_file(tmp_path: Path) -> Path:
    """Three files: events.jsonl.2 in schema 1.0 (written as such files were), then
    events.jsonl.1 and events.jsonl rotated by the EventWriter itself."""
    path = tmp_path / "log" / "events.jsonl"
    w = EventWriter(path, max_bytes=4000, backups=5)
    w.write(decision("pkgs", "pkgs.example.test", "t1", NOW - 10 * DAY))
    w.write(close("pkgs", "pkgs.example.test", "t1", NOW - 10 * DAY, 100, 5000))
    for i, name in enumerate(["a.cdn.example.test", "b.cdn.example.test", "a.cdn.example.test"]):
        w.write(decision("cdn", name, f"t{i + 1}", NOW - 5 * DAY + i))
    w.write(decision(None, "upload2.example.test", "t2", NOW - 2 * DAY, allowed=False))
    w.write(decision("no-upload", "upload.example.test", "t2", NOW - 2 * DAY, allowed=False))
    w.write(decision("gone", "x.test", "t2", NOW - DAY))  # an entry since removed
    # report mode: the rules refused port 8443 of the entry, the flow went through anyway
    odd = decision("pkgs", "pkgs.example.test", "t4", NOW - DAY)
    odd["destination"]["port"], odd["event"]["reason"] = 8443, "port_not_allowed"
    odd["stockade"]["report_only"] = True
    w.write(odd)
    w.write(broker_call("t3", NOW - DAY))
    w.write(decision("old", "old.example.test", "t9", NOW - 200 * DAY))  # outside 90d
    w.close()
    assert (path.parent / "events.jsonl.1").exists(), "the writer rotated"
    old = make_event(component="gateway", action="connection_close", task_id="t0",
                     profile="p", rule_id="pkgs", now=NOW - 20 * DAY)  # fmt: skip
    old["stockade"] = {"component": "gateway", "bytes_up": 7, "bytes_down": 70}
    v1 = decision("pkgs", "pkgs.example.test", "t0", NOW - 20 * DAY)
    lines = [json.dumps(v1), json.dumps(old), '{"torn": ']
    (path.parent / "events.jsonl.2").write_text("\n".join(lines) + "\n")
    return path


def test_accessors_read_new_and_old_names():
    new = close("r", "h", "t", NOW, 5, 50)
    assert (ev.bytes_up(new), ev.bytes_down(new), ev.duration_s(new)) == (5, 50, 1.5)
    assert "stockade" not in new or "bytes_up" not in new["stockade"]
    old = {"stockade": {"bytes_up": 3, "bytes_down": 30, "latency_ms": 250}}
    assert (ev.bytes_up(old), ev.bytes_down(old), ev.duration_s(old)) == (3, 30, 0.25)
    assert (ev.bytes_up({}), ev.duration_s({})) == (0, None)
    assert ev.bytes_up({"source": {"bytes": -1}, "stockade": {"bytes_up": True}}) == 0


def test_event_files_oldest_first(events_file):
    names = [p.name for p in ev.event_files(events_file)]
    assert names[-1] == "events.jsonl" and names[-2] == "events.jsonl.1"
    assert names[0].endswith(str(len(names) - 1)) and "events.jsonl.2" in names


def test_near():
    assert near("pypi.org", "upload.pypi.org") and near("pypi.org", "pypi.org")
    assert near("*.cdn.example", "x.cdn.example") and near("files.example.org", "example.org")
    assert not near("pypi.org", "pypi.org.evil") and not near("a.example.org", "example.net")


def _report(rules: Path, events_file: Path, since: float | None = NOW - 90 * DAY):
    stats = ev.ReadStats()
    events = ev.read_files(ev.event_files(events_file), stats)
    return usage(load_rules(rules), events, NOW, since, TODAY), stats


def test_usage_per_entry(rules, events_file):
    r, stats = _report(rules, events_file)
    by = {u.entry: u for u in r.entries}
    pkgs = by["pkgs"]
    assert (pkgs.hits, pkgs.tasks) == (2, {"t0", "t1"})
    # 100 + 5000 from a schema 2.0 close, 7 + 70 from a schema 1.0 one
    assert (pkgs.bytes_up, pkgs.bytes_down) == (107, 5070)
    assert pkgs.owner == "build-team" and pkgs.status == []
    assert pkgs.last_use == pytest.approx(NOW - 10 * DAY, abs=1)
    assert dict(by["cdn"].served) == {"a.cdn.example.test": 2, "b.cdn.example.test": 1}
    assert len(by["cdn"].tasks) == 3
    # outside the window: unused; and overdue for review
    assert by["old"].hits == 0 and by["old"].status == ["unused", "review overdue"]
    assert by["soon"].status == ["unused", "expires in 4d"]
    assert by["no-upload"].hits == 1 and by["no-upload"].status == []  # a deny that fired
    assert dict(by["pkgs"].denials_near) == {"upload2.example.test": 1,
                                             "upload.example.test": 1,
                                             "pkgs.example.test": 1}  # fmt: skip
    api = by["broker:demo-api"]
    assert (api.hits, api.tasks, api.bytes_up, api.bytes_down) == (1, {"t3"}, 10, 300)
    assert dict(r.unknown) == {("p", "gone"): 1}
    assert {u.entry for u in r.stale} == {"old", "soon"}
    assert sum(stats.bad_lines.values()) == 1 and len(stats.files) >= 3


def test_usage_all_events_counts_the_old_one(rules, events_file):
    r, _ = _report(rules, events_file, since=None)
    old = next(u for u in r.entries if u.entry == "old")
    assert old.hits == 1 and old.status == ["review overdue"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["rules", "usage", "--today", "2026-12-01", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_table_json_and_fail_on_stale(capsys, rules, events_file):
    base = ("--rules", str(rules), "--events", str(events_file), "--since", "all")
    rc, out, err = run(capsys, *base)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["PROFILE", "ENTRY", "KIND", "HITS", "TASKS", "BYTES",
                                "LAST", "USE", "OWNER", "STATUS"]  # fmt: skip
    row = next(x for x in lines if x.startswith("p ") and " pkgs " in x)
    assert row.split()[2:8] == ["allow", "2", "2", "5.1KiB", "2026-11-21T12:00:00Z",
                                "build-team"]  # fmt: skip
    assert "    served: a.cdn.example.test (2), b.cdn.example.test (1)" in lines
    assert any("'gone', which these rules do not have" in x for x in lines)
    assert "1 line(s) are not events; skipped" in err
    rc, out, _ = run(capsys, *base, "--json")
    data = json.loads(out)
    assert rc == 0 and data["stale"] == 2 and data["since"] is None
    entry = next(e for e in data["entries"] if e["entry"] == "cdn")
    assert entry["served"] == {"a.cdn.example.test": 2, "b.cdn.example.test": 1}
    assert run(capsys, *base, "--fail-on-stale")[0] == 1


def test_cli_bad_input_exit_2(capsys, rules, tmp_path):
    rc, _, err = run(capsys, "--rules", str(rules), "--events", str(tmp_path / "none.jsonl"))
    assert rc == 2 and "no events file at" in err
    rc, _, err = run(capsys, "--rules", str(rules), "--events", "x", "--since", "soon")
    assert rc == 2 and "--since" in err
    rc, _, err = run(capsys, "--rules", str(tmp_path / "nope"), "--events", "x")
    assert rc == 2


def test_lint_warns_on_past_review_by(load_profile):
    from stockade.policy.lint import lint_ruleset

    rs = load_profile(textwrap.dedent(PROFILE), apis={"demo-api": API})
    msgs = [p.message for p in lint_ruleset(rs, TODAY)]
    assert any("'old' was due for review on 2026-11-01 (owner: alice)" in m for m in msgs)
    assert not any("'pkgs' was due" in m for m in msgs)


def test_owner_must_say_something(write_rules):
    from stockade.policy.problems import RulesError

    bad = "profile: p\negress:\n  allow:\n    - {host: a.test, reason: r, owner: ' '}\n"
    with pytest.raises(RulesError, match="owner must name"):
        load_rules(write_rules(profiles={"p": bad}))
