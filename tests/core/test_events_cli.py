import json
import subprocess
import sys
import time
from datetime import datetime

import pytest
from sample_events import broker_call

from stockade.cli import main
from stockade.events import EventWriter, cli, make_event
from stockade.events.summary import ThrottleSettings
from stockade.events.view import (
    EventFilter,
    count_events,
    format_line,
    parse_duration,
    parse_when,
    show_time,
)


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


@pytest.fixture
def local_tz(monkeypatch):
    """Local time is UTC+05:30 (a POSIX zone: no tz database needed, no DST)."""
    monkeypatch.setenv("TZ", "STK-5:30")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_parse_when_durations_dates_and_zones(local_tz):
    now = _at("2026-12-01T20:00:00+00:00")
    assert parse_when("30s", now) == now - 30
    assert parse_when("2h", now) == now - 7200
    assert parse_when("2026-12-01T19:00Z", now) == _at("2026-12-01T19:00:00+00:00")
    assert parse_when("2026-12-01T19:00+01:00", now) == _at("2026-12-01T18:00:00+00:00")
    # naive means local, as the viewer prints it
    assert parse_when("2026-12-01T19:00", now) == _at("2026-12-01T13:30:00+00:00")
    assert parse_when("2026-12-01 19:00:05", now) == _at("2026-12-01T13:30:05+00:00")
    assert parse_when("2026-12-01", now) == _at("2026-11-30T18:30:00+00:00")
    # a time alone is today's, in local time (20:00Z is 01:30 on Dec 2 locally)
    assert parse_when("01:00", now) == _at("2026-12-01T19:30:00+00:00")
    for bad in ("soon", "2026-13-01", "25:00", ""):
        with pytest.raises(ValueError, match="invalid time"):
            parse_when(bad, now)


def test_show_time_local_with_zone_and_utc(local_tz):
    at = _at("2026-12-01T19:22:03.1234+00:00")
    ev = make_event(component="gateway", action="rules_reload", now=at)
    assert show_time(ev) == "2026-12-02 00:52:03.123 +05:30"
    assert show_time(ev, utc=True) == "2026-12-01 19:22:03.123Z"
    assert format_line(ev).startswith("2026-12-02 00:52:03.123 +05:30 INFO ")
    assert format_line(ev, utc=True).startswith("2026-12-01 19:22:03.123Z INFO ")
    assert show_time({"@timestamp": "yesterday"}) == "yesterday"


def test_filter():
    f = EventFilter(task="t1", outcome="denied")
    assert f(_ev("t1", "denied"))
    assert not f(_ev("t1", "allowed"))
    assert not f(_ev("t2", "denied"))
    assert not EventFilter(since=time.time() + 10)(_ev("t1", "denied"))
    assert not EventFilter(component="dns")(_ev("t1", "denied"))


def test_filter_until_actions_reasons_labels():
    now = time.time()
    old, new = _ev("t1", "denied", "a", now=now - 3600), _ev("t1", "denied", "b", now=now)
    assert [EventFilter(until=now - 60)(e) for e in (old, new)] == [True, False]
    assert [EventFilter(since=now - 7200, until=now - 60)(e) for e in (old, new)] == [True, False]
    assert not EventFilter(until=now)({"event": {}})  # no time: a time filter cannot keep it
    assert EventFilter(actions=frozenset({"connection_decision", "dns_decision"}))(old)
    assert not EventFilter(actions=frozenset({"dns_decision"}))(old)
    assert [EventFilter(reasons=frozenset({"b"}))(e) for e in (old, new)] == [False, True]
    assert EventFilter(labels=(("task_id", "t1"), ("profile", "p")))(old)
    assert not EventFilter(labels=(("task_id", "t1"), ("profile", "q")))(old)
    # a damaged line (labels not an object) is filtered out, not a crash
    assert not EventFilter(labels=(("profile", "p"),))({"labels": "x"})


def test_format_line_readable_and_colour():
    line = format_line(_ev("t1", "denied", "no_matching_rule"))
    assert "DENY" in line and "task=t1" in line and "evil.test:443" in line
    assert "reason=no_matching_rule" in line and "\x1b[" not in line
    assert "\x1b[31m" in format_line(_ev("t1", "denied"), colour=True)


def test_format_line_reads_new_and_old_byte_fields():
    ev = broker_call(decision="allowed", http_status=200, extra={"api": "github"})
    ev.setdefault("source", {})["bytes"] = 12
    ev.setdefault("destination", {})["bytes"] = 512
    line = format_line(ev)
    assert "api=github" in line and "status=200" in line and "bytes=↑12 ↓512" in line
    # a file written before the fields moved (schema 1.x: stockade.bytes_up/bytes_down)
    legacy = {
        "@timestamp": "2026-11-29T12:00:00.000000Z",
        "event": {"action": "broker_call"},
        "stockade": {"component": "broker", "api": "github", "status": 201,
                     "bytes_up": 3, "bytes_down": 4},
    }
    line = format_line(legacy)
    assert "api=github" in line and "status=201" in line and "bytes=↑3 ↓4" in line
    assert "bytes=" not in format_line(_ev("t1", "denied"))


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
    assert "--since: invalid time" in capsys.readouterr().err
    assert main(["events", "--file", str(tmp_path)]) == 1  # a directory
    assert "cannot read" in capsys.readouterr().err


def test_cli_action_reason_label_until(tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    w.write(_ev("t1", "denied", "no_matching_rule", now=time.time() - 3600))
    w.write(_ev("t2", "denied", "address_forbidden"))
    w.write(make_event(component="dns", action="dns_decision", decision="denied",
                       reason="high_entropy_label", task_id="t3", profile="q"))
    w.close()

    def tasks(*flags):
        assert main(["events", "--file", str(path), "--json", *flags]) == 0
        return [json.loads(x)["labels"]["task_id"] for x in capsys.readouterr().out.splitlines()]

    assert tasks("--action", "dns_decision") == ["t3"]
    assert tasks("--action", "dns_decision,connection_decision") == ["t1", "t2", "t3"]
    assert tasks("--reason", "no_matching_rule", "--reason", "high_entropy_label") == ["t1", "t3"]
    assert tasks("--label", "profile=q") == ["t3"]
    assert tasks("--label", "profile=p", "--label", "task_id=t2") == ["t2"]
    assert tasks("--until", "10m") == ["t1"]
    assert tasks("--since", "2h", "--until", "30m") == ["t1"]
    for flags, message in (
        (["--label", "profile"], "invalid --label 'profile'"),
        (["--action", ","], "--action: no value in ','"),
        (["--until", "tomorrow"], "--until: invalid time"),
        (["--since", "30m", "--until", "2h"], "--since 30m is after --until 2h"),
    ):
        assert main(["events", "--file", str(path), *flags]) == 2
        assert message in capsys.readouterr().err


def test_cli_summary_counts_summarised_events(tmp_path, capsys):
    """5 denials of one key under a throttle: 2 verbatim, 3 in one event_summary; the
    counts say 5, as the gateway decided."""
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, throttle=ThrottleSettings(verbatim_per_key=2))
    for _ in range(5):
        w.write(_ev("t1", "denied", "no_matching_rule"))
    w.write(_ev("t1", "allowed", "allowed_by_rule"))
    w.close()
    actions = [e["event"]["action"] for e in map(json.loads, path.read_text().splitlines())]
    assert actions.count("event_summary") == 1 and actions.count("connection_decision") == 3
    assert main(["events", "--file", str(path), "--summary", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["counts"] == [
        {"action": "connection_decision", "decision": "denied", "reason": "no_matching_rule",
         "count": 5},
        {"action": "connection_decision", "decision": "allowed", "reason": "allowed_by_rule",
         "count": 1},
    ]
    assert out["total"] == 6
    assert main(["events", "--file", str(path), "--summary", "--outcome", "denied"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[1].split() == ["5", "connection_decision", "denied", "no_matching_rule"]
    assert text[-1].split() == ["5", "total"]
    assert main(["events", "--file", str(path), "--summary", "--follow"]) == 2
    assert "cannot --follow" in capsys.readouterr().err


def test_count_events_sorted_by_count():
    evs = [_ev("t", "denied", "a"), _ev("t", "denied", "b"), _ev("t", "denied", "b")]
    assert [(r.reason, r.count) for r in count_events(evs)] == [("b", 2), ("a", 1)]


def test_verify_missing_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cli, "VERIFY_MODULE", "stockade.events.no_such_verifier")
    assert main(["events", "verify", "--key", "k.pub", "events.jsonl"]) == 2
    assert "not available in this build" in capsys.readouterr().err


def test_verify_calls_the_verifier_module(monkeypatch, tmp_path, capsys):
    """When the module is there, its add_arguments shapes the subcommand and its run
    decides the exit code; the view flags on the parent do not get in the way."""
    (tmp_path / "fake_verifier.py").write_text(
        "def add_arguments(p):\n"
        "    p.add_argument('--json', action='store_true')\n"
        "    p.add_argument('files', nargs='*')\n"
        "def run(args):\n"
        "    print('verify', args.json, args.files)\n"
        "    return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "VERIFY_MODULE", "fake_verifier")
    assert main(["events", "verify", "--json", "a.jsonl", "b.jsonl"]) == 1
    assert capsys.readouterr().out == "verify True ['a.jsonl', 'b.jsonl']\n"


@pytest.mark.timeout(60)
def test_follow_sees_new_events_and_rotation(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, max_bytes=1500, backups=3)
    w.write(_ev("t0", "denied"))
    proc = subprocess.Popen(
        # the view flags stay on the parent parser next to the verify subcommand
        [sys.executable, "-m", "stockade", "events", "--file", str(path), "--follow", "--json",
         "--action", "connection_decision", "--since", "1h"],
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


def test_events_verify_runs_the_chain_verifier(tmp_path, capsys):
    """`stockade events verify` reaches the real verifier: a clean chained file is intact
    (exit 0), and one edited byte is a finding (exit 1)."""
    from stockade.events.settings import EventSettings

    chain = tmp_path / "chain"
    path = tmp_path / "events.jsonl"
    w = EventSettings(chain_dir=str(chain), checkpoint_every=5).writer(path, None, False)
    for i in range(12):
        w.write(_ev(f"t{i}", "denied", "no_matching_rule"))
    w.close()
    argv = ["events", "verify", "--key", str(chain / "signing.pub"),
            "--heads", str(chain / "heads"), "--json", str(path)]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    rows = path.read_bytes().splitlines(keepends=True)
    rows[3] = rows[3].replace(b'"t3"', b'"t9"')
    path.write_bytes(b"".join(rows))
    assert main(argv) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
