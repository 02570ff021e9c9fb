"""The inspector child's own event throttle, end to end: a real gateway service with its
real inspector (mitmproxy) child. The child writes its ended windows' summaries on its
own, and a deregistered task's summaries and `event_totals` as soon as the gateway tells
it the task ended (a line on its stdin), not only when the child stops."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_harness import GatewayHarness, registered_client, running_gateway
from polling import wait_until
from test_gw_inspection import curl, l7_config, split

from stockade.events.taskstore import read_task_events
from stockade.testing.testnet import FakeInternet

pytestmark = pytest.mark.netns

POSTS = 3  # denied POSTs: 1 written verbatim (verbatim_per_key), the rest summarised


@pytest.fixture(scope="module")
def evgw(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHarness]:
    path = l7_config(tmp_path_factory.mktemp("l7ev"), fake_internet,
                     events={"verbatim_per_key": 1, "summary_window_s": 1.0})
    with running_gateway(path, inspector=True) as h:
        yield h


def _stored(gw: GatewayHarness, task: str, action: str) -> list[dict[str, Any]]:
    return [e for e in read_task_events(Path(gw.config.task_events_dir), task)
            if e["event"]["action"] == action]


def _wait_stored(gw: GatewayHarness, task: str, action: str) -> list[dict[str, Any]]:
    return wait_until(lambda: _stored(gw, task, action), 30, 0.1,  # the test's own patience
                      what=f"no {action} for {task} in the task store")


def _requests(gw: GatewayHarness, fi: FakeInternet, ns: Any) -> None:
    """One allowed GET and POSTS denied POSTs through the inspector."""
    r = curl(ns, fi, gw, "echo.test", "https://echo.test/allowed/x")
    assert r.returncode == 0 and split(r)[0] == 200, r.stdout + r.stderr
    for _ in range(POSTS):
        r = curl(ns, fi, gw, "echo.test", "-X", "POST", "--data", "x=1",
                 "https://echo.test/allowed/x")
        assert r.returncode == 0 and split(r)[0] == 403, r.stdout + r.stderr


def _inspector_summaries(gw: GatewayHarness, task: str) -> int:
    return sum(e["stockade"]["summary"]["count"] for e in _stored(gw, task, "event_summary")
               if e["event"]["reason"] == "method_not_allowed")


def test_a_quiet_tasks_inspector_summary_is_written_once_its_window_ends(
    evgw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    """No later event of the task is needed: the child flushes ended windows itself."""
    with registered_client(evgw, "t-ev-quiet", "l7", "ev") as ns:
        _requests(evgw, fake_internet, ns)
        _wait_stored(evgw, "t-ev-quiet", "event_summary")
        wait_until(lambda: _inspector_summaries(evgw, "t-ev-quiet") == POSTS - 1, 10, 0.1)
        assert _inspector_summaries(evgw, "t-ev-quiet") == POSTS - 1
        assert evgw.svc.registry.get("t-ev-quiet") is not None  # type: ignore[union-attr]


def test_deregistration_brings_the_inspectors_totals_into_the_task_store(
    evgw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    insp = evgw.svc.inspector  # type: ignore[union-attr]
    assert insp is not None
    pid = insp.pid
    with registered_client(evgw, "t-ev-end", "l7", "ev") as ns:
        _requests(evgw, fake_internet, ns)
        assert _stored(evgw, "t-ev-end", "request_decision")
    # registered_client deregistered the task; the inspector keeps running
    rows = wait_until(lambda: [  # the test's own patience, not a speed requirement
        r for e in _stored(evgw, "t-ev-end", "event_totals") for r in e["stockade"]["totals"]["by"]
        if r["reason"] in ("allowed_by_rule", "method_not_allowed")], 30, 0.1)
    by_reason = {r["reason"]: (r["written"], r["summarised"]) for r in rows}
    assert by_reason == {"allowed_by_rule": (1, 0), "method_not_allowed": (1, POSTS - 1)}
    assert _inspector_summaries(evgw, "t-ev-end") == POSTS - 1
    assert insp.pid == pid and insp.ready  # told, not stopped
