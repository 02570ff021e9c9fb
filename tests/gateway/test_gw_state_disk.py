"""The gateway on a full state disk (a real tmpfs, filled up): registration answers a JSON
507 and keeps nothing in memory; the sweep loops (task expiry, rule polling) keep running
through the failed saves and catch up once the disk has room."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gw_harness import GatewayHarness, write_config
from gw_rules import write_rules
from polling import wait_until

from stockade.tasks import ControlError

DEADLINE_S = 30.0  # the test's own patience, not a speed requirement


def _wait(what: str, cond: Callable[[], bool]) -> None:
    wait_until(cond, DEADLINE_S, 0.1, what=what)


def test_full_state_disk(tmp_path: Path, full_disk: Callable[[str], Any]) -> None:
    disk = full_disk("state")  # the config's state_dir is tmp_path/state
    rules = write_rules(tmp_path / "rules")
    cfg = write_config(tmp_path, rules, transparent_listen=["127.0.0.1:0"],
                       proxy_listen=["127.0.0.1:0"], rules_poll_interval_s=0.3,
                       inspection={"enabled": False})
    gw = GatewayHarness(cfg).start()
    try:
        assert gw.svc is not None
        registry = gw.svc.registry
        state = Path(registry.state_file or "")
        gw.register("t-old", "10.77.0.2", "web", expires_at=time.time() + 1)
        disk.fill()
        with pytest.raises(ControlError) as e:
            gw.register("t-new", "10.77.0.3", "web")
        assert e.value.status == 507
        assert e.value.body["error"] == "state_write_failed"
        assert "No space left on device" in e.value.body["detail"]
        assert registry.get("t-new") is None
        assert [t.task_id for t in gw.control.list()] == ["t-old"]
        # t-old expires while the disk is full: never answers as a task, record kept
        _wait("t-old expired", lambda: registry.by_address("10.77.0.2") is None)
        time.sleep(1.0)  # several failed expiry rounds (0.25 s each)
        assert registry.get("t-old") is not None
        assert "t-old" in state.read_text() and "t-new" not in state.read_text()
        # the sweep is alive: a rule file change is still picked up
        profile = rules / "profiles" / "web.yaml"
        profile.write_text(profile.read_text().replace("reason: wildcard",
                                                       "reason: wildcard names"))
        _wait("rules reloaded from the file change", lambda: any(
            e["event"]["action"] == "rules_reload"
            and e["stockade"].get("trigger") == "file_change" for e in gw.events()))
        # room again: the expiry catches up, memory and disk agree
        disk.free()
        _wait("t-old removed", lambda: registry.get("t-old") is None)
        assert json.loads(state.read_text()) == {"tasks": []}
        gw.register("t-new", "10.77.0.3", "web")
        assert [t.task_id for t in gw.control.list()] == ["t-new"]
    finally:
        gw.stop()
