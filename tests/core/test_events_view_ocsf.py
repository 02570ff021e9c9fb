"""`stockade events` reads OCSF lines as it reads ECS ones: the same events written once
by an ECS writer and once by an OCSF writer (`events.format: ocsf`) give the same lines,
the same matches for every filter and the same --summary."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import sample_events

from stockade.cli import main
from stockade.events import EventWriter, follow, make_event, read_events
from stockade.events.ecsview import ecs_view
from stockade.events.ocsf import to_ocsf
from stockade.events.settings import EventSettings
from stockade.events.summary import ThrottleSettings
from stockade.events.view import EventFilter, format_line

T0 = 1_796_155_200.0  # 2026-12-01T20:00:00Z; whole milliseconds, as OCSF keeps times


def _events() -> list[dict[str, Any]]:
    """One of each shape the viewer prints, a minute apart."""
    evs = [
        sample_events.denial(rule_id="r-7"),
        sample_events.dns_decision("x.evil.test", "TXT", decision="denied",
                                   reason="high_entropy_label", task_id="t-2", profile="dns-p"),
        sample_events.broker_call(decision="allowed", task_id="t-1", profile="pypi-build",
                                  http_method="POST", http_status=201,
                                  url={"path": "/repos/o/r/issues"},
                                  destination_domain="api.github.com", destination_port=443,
                                  extra={"api": "github"}, message="issue created"),
        sample_events.bypass_attempt(reason="direct_egress", task_id="t-3",
                                     destination_ip="203.0.113.9", destination_port=53),
        make_event(component="gateway", action="request_decision", decision="allowed",
                   task_id="t-1", profile="pypi-build", http_method="GET",
                   destination_domain="pypi.org", destination_port=443,
                   url={"path": "/simple/x/"}, http_status=200, report_only=True),
        make_event(component="gateway", action="connection_close", reason="upload_limit",
                   task_id="t-2", destination_domain="files.test", destination_port=443,
                   extra={"bytes_up": 12, "bytes_down": 512}),
        make_event(component="launcher", action="sandbox_lifecycle", task_id="t-3",
                   extra={"lifecycle": "start"}, message="sandbox up"),
    ]
    evs += [sample_events.denial(task_id="t-4") for _ in range(4)]  # 2 verbatim, 1 summary
    for i, ev in enumerate(evs):
        ev["@timestamp"] = make_event(component="gateway", action="x",
                                      now=T0 + 60 * i + 0.5)["@timestamp"]
    return evs


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """The events through a throttling ECS writer, then what it wrote through an OCSF one:
    the same lines, summaries and totals included, in each shape."""
    out = {"ecs": tmp_path / "ecs.jsonl", "ocsf": tmp_path / "ocsf.jsonl"}
    w = EventWriter(out["ecs"], throttle=ThrottleSettings(verbatim_per_key=2))
    for ev in _events():
        w.write(ev)
    w.end_task("t-4")  # the throttled denials' event_summary and the task's totals
    w.close()
    ocsf = EventWriter(out["ocsf"], encode=EventSettings(format="ocsf").encoder())
    for ev in read_events(out["ecs"]):
        ocsf.write(ev)
    ocsf.close()
    assert all("class_uid" in json.loads(x) for x in out["ocsf"].read_text().splitlines())
    return out


def _view(capsys: pytest.CaptureFixture[str], path: Path, *flags: str) -> list[str]:
    assert main(["events", "--file", str(path), "--utc", "--color", "never", *flags]) == 0
    return capsys.readouterr().out.splitlines()


FLAGS: list[tuple[str, ...]] = [
    (),
    ("--since", "2026-12-01T20:02:00Z"),
    ("--until", "2026-12-01T20:03:00.500Z"),
    ("--since", "2026-12-01T20:01:00Z", "--until", "2026-12-01T20:05:00Z"),
    ("--action", "dns_decision,broker_call"),
    ("--reason", "no_matching_rule"),
    ("--reason", "upload_limit", "--reason", "direct_egress"),
    ("--task", "t-2"),
    ("--label", "profile=pypi-build"),
    ("--label", "profile=pypi-build", "--label", "task_id=t-4"),
    ("--outcome", "denied"),
    ("--component", "launcher"),
    ("--summary",),
    ("--summary", "--json"),
    ("--summary", "--reason", "no_matching_rule"),
]


@pytest.mark.parametrize("flags", FLAGS, ids=" ".join)
def test_every_flag_gives_the_same_output_on_either_shape(files, capsys, flags):
    ecs = _view(capsys, files["ecs"], *flags)
    assert ecs, "each case matches something, or it would compare nothing"
    assert _view(capsys, files["ocsf"], *flags) == ecs


def test_the_lines_say_what_the_events_say(files, capsys):
    lines = _view(capsys, files["ocsf"])
    assert len(lines) == 11  # 7, 2 verbatim denials, their event_summary, the totals
    assert all(" ? " not in line and "task=-" not in line for line in lines[:-1])
    joined = "\n".join(lines)
    for part in ("2026-12-01 20:00:00.500Z DENY", "reason=no_matching_rule", "rule=r-7",
                 "x.evil.test TXT", "POST api.github.com:443/repos/o/r/issues", "api=github",
                 "status=201", "- issue created", "203.0.113.9:53", "REPORT",
                 "bytes=↑12 ↓512", "sandbox_lifecycle", "profile=pypi-build",
                 "src=10.213.0.2", "event_summary"):
        assert part in joined, part
    counts = json.loads(_view(capsys, files["ocsf"], "--summary", "--json")[0])
    assert counts["total"] == 12  # the summary counts as the 2 denials it did not write


def test_follow_reads_ocsf_lines_too(files, capsys, monkeypatch):
    def stop(_: float) -> None:
        raise BrokenPipeError  # the CLI ends quietly on it, as when the reader goes away

    monkeypatch.setattr(follow, "lines", functools.partial(follow.lines, poll=0, sleep=stop))
    outs = [_view(capsys, files[k], "--follow", "--task", "t-1") for k in ("ecs", "ocsf")]
    assert len(outs[0]) == 3 and outs[1] == outs[0]


@pytest.mark.parametrize("ocsf", [
    {"class_uid": 4001},
    {"class_uid": 4001, "time": "soon", "metadata": [], "unmapped": {"labels": 3, "event": 1},
     "evidences": "x", "traffic": None, "query": {"hostname": 7}},
    {"class_uid": 2004, "time": 10**15, "evidences": ["x"], "http_request": {"url": "x"}},
])
def test_a_damaged_ocsf_line_is_shown_for_what_it_holds(ocsf):
    before = copy.deepcopy(ocsf)
    line = format_line(ocsf, utc=True)
    assert line.startswith("? INFO  ?") and "task=-" in line
    assert not EventFilter(since=0.0)(ocsf)  # no readable time: a time filter cannot vouch
    assert ocsf == before  # read, not changed


def test_an_ecs_line_is_read_as_it_is():
    ev = sample_events.denial()
    assert ecs_view(ev) is ev and ecs_view(to_ocsf(ev))["event"]["reason"] == "no_matching_rule"
