import json
import subprocess
import sys
import time

import pytest

from stockade.cli import main
from stockade.events import EventWriter, make_event
from stockade.events.view import EventFilter, format_line, parse_duration


def _ev(task, decision, reason=None, now=None, component="gateway"):
    return make_event(
        component=component,
        action="connection_decision",
        decision=decision,
        reason=reason,
        task_id=task,
        profile="p",
        destination_domain="evil.test",
        destination_port=443,
        now=now,
    )


@pytest.fixture
def events_file(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    w.write(_ev("t1", "denied", "no_matching_rule", now=time.time() - 3600))
    w.write(_ev("t1", "allowed", "allowed_by_rule"))
    w.write(_ev("t2", "denied", "address_forbidden"))
    w.close()
    return path


def test_parse_duration():
    assert parse_duration("90") == 90
    assert parse_duration("5m") == 300
    assert parse_duration("2h") == 7200
    assert parse_duration("1d") == 86400
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_filter():
    f = EventFilter(task="t1", outcome="denied")
    assert f(_ev("t1", "denied"))
    assert not f(_ev("t1", "allowed"))
    assert not f(_ev("t2", "denied"))
    assert not EventFilter(since=time.time() + 10)(_ev("t1", "denied"))
    assert not EventFilter(component="dns")(_ev("t1", "denied"))


def test_format_line_readable_and_colour():
    line = format_line(_ev("t1", "denied", "no_matching_rule"))
    assert "DENY" in line and "task=t1" in line and "evil.test:443" in line
    assert "reason=no_matching_rule" in line and "\x1b[" not in line
    assert "\x1b[31m" in format_line(_ev("t1", "denied"), colour=True)


def test_cli_json_passthrough_and_filters(events_file, capsys):
    assert main(["events", "--file", str(events_file), "--json", "--outcome", "denied"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [e["labels"]["task_id"] for e in out] == ["t1", "t2"]
    assert main(["events", "--file", str(events_file), "--since", "10m", "--task", "t2"]) == 0
    text = capsys.readouterr().out
    assert text.count("\n") == 1 and "address_forbidden" in text


def test_cli_missing_file_and_bad_since(tmp_path, capsys):
    assert main(["events", "--file", str(tmp_path / "none.jsonl")]) == 1
    assert main(["events", "--file", str(tmp_path / "none.jsonl"), "--since", "x"]) == 2
    assert "invalid duration" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_follow_sees_new_events_and_rotation(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, max_bytes=1500, backups=3)
    w.write(_ev("t0", "denied"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "stockade", "events", "--file", str(path), "--follow", "--json"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        seen = [json.loads(proc.stdout.readline())["labels"]["task_id"]]
        for i in range(1, 8):  # enough to rotate the file more than once
            w.write(_ev(f"t{i}", "denied"))
            seen.append(json.loads(proc.stdout.readline())["labels"]["task_id"])
        assert seen == [f"t{i}" for i in range(8)]
        assert (tmp_path / "events.jsonl.1").exists()
    finally:
        proc.kill()
        proc.wait()
