"""A sandbox run by a launcher that does not hold the NFLOG group: the reader (another
launcher) writes its pending summaries and `event_totals` for the sandbox once it sees the
sandbox's record go, not only when its own writer closes, and the run's end event waits
for them and counts them (docs/events.md)."""

from __future__ import annotations

from typing import Any

import pytest
from polling import eventually
from stockade.launcher import Launcher, SandboxSpec

from stockade.events import validate
from stockade.events.taskstore import read_task_events

from .conftest import Lab

pytestmark = pytest.mark.netns

BLOCKED = r"""
import os, socket, time
gw = os.environ["STOCKADE_BROKER"].split("//")[1].split(":")[0]  # host side of the veth
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(300):
    try:
        s.sendto(b"x", (gw, 1000 + i))
    except OSError:  # an ICMP error of an earlier reject
        pass
time.sleep(1)
"""


def _launcher_totals(lab: Lab, task_id: str) -> list[dict[str, Any]]:
    return [e for e in read_task_events(lab.config.task_events_dir, task_id)
            if e["event"]["action"] == "event_totals"
            and e["stockade"]["component"] == "launcher"]


def test_the_readers_totals_of_another_launchers_sandbox_are_written(lab: Lab) -> None:
    # the lab's launcher's reader binds the NFLOG group
    assert eventually(lambda: lab.launcher.nflog_bound, 30, 0.1)  # it reads every sandbox's records
    other = Launcher(lab.config, nflog=False)
    try:
        res = other.run(SandboxSpec("test", ["python3", "-c", BLOCKED]), lab.ruleset)
    finally:
        other.close()
    tid = res.task_id
    assert res.exit_code == 0, res.stderr
    assert lab.bypass(tid)  # the lab's reader wrote the blocked packets' events
    # the run's writer tallied nothing of it (its lifecycle events are exempt); the
    # reader ended its tally when it saw the sandbox's record go, and the run waited for
    # that before its end event
    totals = _launcher_totals(lab, tid)
    assert len(totals) == 1, totals
    validate(totals[0])
    written = totals[0]["stockade"]["totals"]["written"]
    assert written >= len(lab.bypass(tid)) > 0
    assert tid not in lab.launcher._logged
    stored = read_task_events(lab.config.task_events_dir, tid)
    end = [e for e in stored if e["stockade"].get("lifecycle") == "end"]
    assert len(end) == 1
    assert end[0]["stockade"]["event_totals"]["launcher"]["written"] == written
    assert stored.index(totals[0]) < stored.index(end[0])
