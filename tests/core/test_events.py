import json
import multiprocessing
import os
from collections import Counter
from typing import Any

import jsonschema
import pytest
from sample_events import broker_call, bypass_attempt, denial, dns_decision

from stockade.events import EventWriter, make_event, read_events, validate
from stockade.events.taskstore import read_task_events

_denial = denial


def test_denial_uses_ecs_fields_and_validates():
    ev = _denial()
    validate(ev)
    assert ev["event"]["outcome"] == "failure"
    assert ev["event"]["type"] == ["connection", "denied"]
    assert ev["event"]["reason"] == "no_matching_rule"
    assert ev["destination"] == {"domain": "evil.test", "port": 443}
    assert ev["labels"] == {"task_id": "t-1", "profile": "pypi-build"}
    assert ev["rule"] == {"ruleset": "abc123"}
    assert ev["stockade"]["schema_version"] == "2.0"
    assert ev["ecs"] == {"version": "9.4.0"}
    assert ev["event"]["dataset"] == "stockade.gateway" and ev["event"]["module"] == "stockade"
    assert ev["observer"]["type"] == "firewall" and ev["observer"]["vendor"] == "Stockade"
    assert ev["stockade"]["decision"] == "denied"


def test_allow_close_dns_broker_and_bypass_shapes_validate():
    validate(_denial(decision="allowed", reason="allowed_by_rule", rule_id="r1"))
    close = make_event(
        component="gateway",
        action="connection_close",
        task_id="t",
        extra={"bytes_up": 10, "bytes_down": 20, "duration_s": 0.5},
    )
    validate(close)
    assert close["event"]["type"] == ["end", "connection"]
    assert close["source"] == {"bytes": 10} and close["destination"] == {"bytes": 20}
    assert close["network"] == {"bytes": 30} and close["event"]["duration"] == 500_000_000
    assert "bytes_up" not in close["stockade"] and "duration_s" not in close["stockade"]
    validate(dns_decision("x.test", "TXT", decision="denied", reason="qtype_refused",
                          dns_response_code="REFUSED"))
    validate(broker_call(decision="allowed", http_method="GET", http_status=200,
                         url={"path": "/v1/whoami"}, extra={"api": "demo", "latency_ms": 1.5}))
    bypass = bypass_attempt()
    validate(bypass)
    assert bypass["event"]["kind"] == "alert"


def test_schema_rejects_unknown_top_level_field():
    ev = _denial()
    ev["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate(ev)


def test_report_only_flag():
    ev = _denial(decision="allowed", report_only=True)
    validate(ev)
    assert ev["stockade"]["report_only"] is True


def test_writer_json_lines_flushed_per_event(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    w.write(_denial())
    # readable before close: flushed per event
    assert len(read_events(path)) == 1
    w.write(_denial(task_id="t-2"))
    assert [e["labels"]["task_id"] for e in read_events(path)] == ["t-1", "t-2"]
    assert w.written == 2 and w.dropped == 0
    w.close()


def test_writer_rotates_by_size_and_keeps_every_event(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, max_bytes=2000, backups=50)
    for i in range(60):
        w.write(_denial(task_id=f"t-{i}"))
    w.close()
    files = sorted(tmp_path.glob("events.jsonl*"))
    assert len(files) > 1
    seen = {e["labels"]["task_id"] for f in files for e in read_events(f)}
    assert seen == {f"t-{i}" for i in range(60)}
    assert all(os.path.getsize(f) <= 2000 for f in files)


def test_writer_counts_what_it_cannot_write(tmp_path):
    w = EventWriter(tmp_path / "e.jsonl")
    assert w.write({"bad": object()}) is False
    assert w.dropped == 1
    # the log directory replaced by a file (works as root too): counted, never raised
    w2 = EventWriter(tmp_path / "sub" / "e.jsonl")
    (tmp_path / "sub").rmdir()
    (tmp_path / "sub").write_text("a file where the directory was")
    assert w2.write(_denial()) is False
    assert w2.dropped == 1


def test_writer_subscribers_and_recent(tmp_path):
    got = []
    w = EventWriter(None, keep_recent=2)
    w.subscribe(got.append)
    for i in range(3):
        w.write(_denial(task_id=str(i)))
    assert [e["labels"]["task_id"] for e in w.recent] == ["1", "2"]
    assert len(got) == 3


def test_stdout_is_json(capsys):
    w = EventWriter(None, stdout=True)
    w.write(_denial())
    out = capsys.readouterr().out
    assert json.loads(out)["event"]["action"] == "connection_decision"


def test_two_writers_share_one_file_across_rotation(tmp_path):
    """Gateway and broker append to one events file; neither loses events when the other
    rotates it."""
    path = tmp_path / "events.jsonl"
    a = EventWriter(path, max_bytes=3000, backups=100)
    b = EventWriter(path, max_bytes=3000, backups=100)
    for i in range(40):
        (a if i % 2 else b).write(_denial(task_id=f"t-{i}"))
    a.close()
    b.close()
    files = list(tmp_path.glob("events.jsonl*"))
    assert len(files) > 2
    seen = [e["labels"]["task_id"] for f in files for e in read_events(f)]
    assert sorted(seen) == sorted(f"t-{i}" for i in range(40))


def _race_writer(path: str, task_dir: str, who: int, n: int, start: Any) -> None:
    w = EventWriter(path, max_bytes=1500, backups=1000, task_dir=task_dir)
    start.wait()
    for i in range(n):
        w.write(_denial(task_id=f"t{who}", rule_id=f"{who}-{i}"))
    w.close()
    os._exit(min(w.dropped, 100))  # the parent reads what this writer lost


def test_writers_in_processes_rotating_at_once_lose_nothing(tmp_path):
    """Gateway, DNS firewall, broker and launcher rotate one file from four processes: a
    rename another one did first is not a lost event, in the file or the task's store."""
    ctx = multiprocessing.get_context("fork")
    path, tasks = tmp_path / "events.jsonl", tmp_path / "tasks"
    start = ctx.Event()
    procs = [ctx.Process(target=_race_writer, args=(str(path), str(tasks), k, 150, start))
             for k in range(4)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]  # no writer dropped an event
    seen = Counter(e["rule"]["id"] for f in tmp_path.glob("events.jsonl*") for e in read_events(f))
    want = {f"{k}-{i}" for k in range(4) for i in range(150)}
    assert set(seen) == want and set(seen.values()) == {1}
    for k in range(4):
        stored = [e["rule"]["id"] for e in read_task_events(tasks, f"t{k}")]
        assert stored == [f"{k}-{i}" for i in range(150)]
