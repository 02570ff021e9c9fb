"""A sandbox run by a launcher that does not hold the NFLOG group: the reader (another
launcher) writes its pending summaries and `event_totals` for the sandbox once it sees the
sandbox's record go, not only when its own writer closes (docs/events.md)."""

from __future__ import annotations

import time
from typing import Any

import pytest
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
    for _ in range(300):  # the lab's launcher's reader binds the NFLOG group
        if lab.launcher.nflog_bound:
            break
        time.sleep(0.1)
    assert lab.launcher.nflog_bound  # it reads every sandbox's records
    other = Launcher(lab.config, nflog=False)
    try:
        res = other.run(SandboxSpec("test", ["python3", "-c", BLOCKED]), lab.ruleset)
    finally:
        other.close()
    tid = res.task_id
    assert res.exit_code == 0, res.stderr
    assert lab.bypass(tid)  # the lab's reader wrote the blocked packets' events
    # the run's writer tallied nothing of it (its lifecycle events are exempt); the
    # reader's tally is written once it sees the sandbox's record gone
    deadline = time.monotonic() + 30
    while not _launcher_totals(lab, tid) and time.monotonic() < deadline:
        time.sleep(0.1)
    totals = _launcher_totals(lab, tid)
    assert len(totals) == 1, totals
    validate(totals[0])
    assert totals[0]["stockade"]["totals"]["written"] >= len(lab.bypass(tid))
    assert tid not in lab.launcher._logged
