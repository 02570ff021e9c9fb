"""A deregistration the gateway refuses (507 on its full state disk) is retried, and the
address stays out of use meanwhile: the task never stays registered under an address a
new sandbox gets (launcher/deregistration.py)."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from stockade.launcher import Launcher

from stockade.tasks import TaskRegistry

from .conftest import Lab, control_server

pytestmark = pytest.mark.netns


@pytest.fixture
def full_gateway(lab: Lab, tmp_path: Path, full_disk: Any) -> Iterator[tuple[Any, TaskRegistry,
                                                                             Lab]]:
    """A gateway registry on a small disk, and a launcher of its own that registers there
    (own table, names, cgroups, scratch, addresses) in a copy of the lab."""
    disk = full_disk("gwstate")
    registry = TaskRegistry(disk.path / "gateway-tasks.json")
    sock = tmp_path / "gw.sock"
    sfx = secrets.token_hex(2)
    settings = lab.config.launcher.model_copy(update={
        "nft_table": f"stockade_dr{sfx}", "name_prefix": f"d{sfx[:3]}",
        "cgroup_parent": f"stockade_dr{sfx}", "scratch_dir": str(tmp_path / "sbx"),
        "address_pool": f"10.215.{100 + secrets.randbelow(100)}.0/30"})  # one address
    cfg = lab.config.model_copy(update={
        "state_dir": str(tmp_path / "state"), "launcher": settings,
        "gateway": lab.config.gateway.model_copy(update={"control_socket": str(sock)})})
    with control_server(registry, sock):
        launcher = Launcher(cfg, nflog=False)
        launcher.start()
        try:
            yield disk, registry, dataclasses.replace(lab, launcher=launcher, config=cfg)
        finally:
            disk.free()
            launcher.close()


def _killed_on_a_full_disk(disk: Any, registry: TaskRegistry, box: Lab) -> str:
    """A sandbox registered while the gateway's disk had room, killed once it is full."""
    t, row = box.background(["sleep", "60"])
    task_id = row["task_id"]
    assert [x.task_id for x in registry.tasks()] == [task_id]
    disk.fill()
    box.launcher.kill(task_id)
    t.join(30)
    assert not t.is_alive()
    return task_id


def test_a_refused_deregistration_is_retried_by_reconcile(full_gateway: Any) -> None:
    disk, registry, box = full_gateway
    task_id = _killed_on_a_full_disk(disk, registry, box)
    # the gateway still holds the task: the launcher keeps its record (and its address)
    assert [x.task_id for x in registry.tasks()] == [task_id]
    rec = box.launcher.state.read()[task_id]
    assert rec.state == "deregistering"
    assert rec.deregister == [box.config.gateway.control_socket]
    assert box.launcher.deregister_failures == 1
    assert box.broker_registry.get(task_id) is None  # the broker's disk had room
    # its end event was written once, by the kill that tore it down
    ends = [e for e in box.events(task_id) if e["stockade"].get("lifecycle") == "end"]
    assert len(ends) == 1

    box.launcher.reconcile()  # the disk is still full: still pending, counted again
    assert [x.task_id for x in registry.tasks()] == [task_id]
    assert box.launcher.state.read()[task_id].deregister_failures == 2
    assert box.launcher.deregister_failures == 2

    disk.free()
    box.launcher.reconcile()
    assert registry.tasks() == []
    assert box.launcher.state.read() == {}
    ends = [e for e in box.events(task_id) if e["stockade"].get("lifecycle") == "end"]
    assert len(ends) == 1  # the retry writes no second end event


def test_an_address_whose_task_is_still_registered_is_not_handed_out(
        full_gateway: Any) -> None:
    disk, registry, box = full_gateway
    old = _killed_on_a_full_disk(disk, registry, box)
    old_ip = box.launcher.state.read()[old].guest_ip
    # the pool's one address is still the old task's at the gateway: fail closed
    with pytest.raises(RuntimeError, match="exhausted"):
        box.run(["true"])
    assert [x.task_id for x in registry.tasks()] == [old]

    disk.free()  # the next claim deregisters the old task first, then reuses its address
    t, row = box.background(["sleep", "60"])
    assert row["address"] == old_ip and row["task_id"] != old
    assert [x.task_id for x in registry.tasks()] == [row["task_id"]]
    box.launcher.kill(row["task_id"])
    t.join(30)
    assert registry.tasks() == [] and box.launcher.state.read() == {}


def _rec(state: str = "running") -> Any:
    from stockade.launcher.state import SandboxRecord
    return SandboxRecord("t1", "p", 0, "if", "ns", "10.0.0.1", "10.0.0.2", "02:00", state=state)


def test_settle_claims_the_end_once_and_keeps_what_is_owed() -> None:
    from stockade.launcher.deregistration import settle
    records = {"t1": _rec()}
    ended = settle(records, "t1", ["/gw.sock"], bypass=3)
    assert ended is not None and ended.state == "running" and ended.bypass == 3
    assert records["t1"].state == "deregistering" and records["t1"].deregister == ["/gw.sock"]
    assert settle(records, "t1", ["/gw.sock"]) is None  # a retry claims nothing
    assert records["t1"].deregister_failures == 2
    assert settle(records, "t1", []) is None and records == {}
    assert settle(records, "t1", []) is None
    records = {"t1": _rec()}
    assert settle(records, "t1", []) is not None and records == {}
