"""Leak test and crash recovery: create/kill cycles and a SIGKILLed launcher leave nothing.

STOCKADE_LEAK_CYCLES sets the cycle count (default 200; each cycle is a full sandbox)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from polling import eventually, wait_until
from stockade.launcher import SandboxSpec, netns, nft
from stockade.launcher.cgroups import CgroupSet, Limits

from .conftest import Lab, runsc_ids
from .sessions_rig import host_leftovers

pytestmark = pytest.mark.netns

CYCLES = int(os.environ.get("STOCKADE_LEAK_CYCLES", "200"))


def leftovers(lab: Lab) -> dict[str, Any]:
    return {
        **host_leftovers(lab.config.launcher),
        "state": lab.launcher.list(),
        "gateway": [t.task_id for t in lab.gateway_registry.tasks()],
        "broker": [t.task_id for t in lab.broker_registry.tasks()],
    }


EMPTY = {"netns": [], "links": [], "elements": {}, "cgroups": [], "scratch": [], "mounts": [],
         "state": [], "gateway": [], "broker": []}


def _start_and_kill(lab: Lab) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def go() -> None:
        box["r"] = lab.launcher.run(SandboxSpec("test", ["sleep", "60"]), lab.ruleset)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    wait_until(lab.launcher.list, interval=0.002, what="the sandbox in the list")
    lab.launcher.kill(lab.launcher.list()[0]["task_id"])
    t.join(timeout=20)
    return box


def test_create_kill_cycles_leave_nothing(lab: Lab) -> None:
    assert leftovers(lab) == EMPTY
    for i in range(CYCLES):
        if i % 2 == 0:
            res = lab.run(["true"])
            assert res.exit_code == 0
            continue
        box = _start_and_kill(lab)
        assert box["r"].ended_by == "killed"
    assert leftovers(lab) == EMPTY


CRASHER = r"""
import json, sys, types
from stockade.config import Config
from stockade.launcher import Launcher, SandboxSpec
from stockade.policy.model import Limits, Profile
cfg = Config.model_validate(json.loads(sys.argv[1]))
name, isolation = sys.argv[2], sys.argv[3]
# sampled, as the lab's: its observers answer no fence self-test (and it samples none)
rs = types.SimpleNamespace(profiles={name: Profile(name, "t", isolation=isolation,
                                                   limits=Limits(ttl=60), selftest="sampled")},
                           version="x")
Launcher(cfg, nflog=False).run(SandboxSpec(name, ["sleep", "60"]), rs)
"""


def test_reconcile_after_launcher_crash(lab: Lab, tier: str) -> None:
    """A launcher SIGKILLed while its sandbox runs (in the gVisor tier too: `runsc run`
    and its sandbox outlive it); reconcile removes everything, runsc's container too."""
    cfg = lab.config.model_dump()
    proc = subprocess.Popen([sys.executable, "-c", CRASHER, json.dumps(cfg), tier,
                             "gvisor" if tier == "gv" else "container"])
    try:
        rows = eventually(lambda: [r for r in lab.launcher.list() if r["state"] == "running"],
                          interval=0.01)
        assert lab.launcher.list(), "crasher did not start its sandbox"
        # its command runs in the cgroup before the launcher dies (checked below)
        s = lab.config.launcher
        wait_until(CgroupSet(s.cgroup_root, s.cgroup_parent, rows[0]["task_id"]).pids,
                   what="the crasher's sandbox's processes")
        if tier == "gv":  # runsc writes its state once started
            wait_until(lambda: lab.launcher.list()[0]["task_id"] in runsc_ids(lab),
                       what="runsc's container state")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = leftovers(lab)
    assert left["netns"] and left["cgroups"] and left["state"]  # the crash left pieces
    # and its sandbox's processes still run (unshare is in its own session)
    s = lab.config.launcher
    assert CgroupSet(s.cgroup_root, s.cgroup_parent, left["cgroups"][0]).pids()
    tid = left["state"][0]["task_id"]
    if tier == "gv":
        assert tid in runsc_ids(lab)
    removed = lab.launcher.reconcile()
    assert removed["sandboxes"] == [tid]
    if tier == "gv":
        assert runsc_ids(lab) == []
    after = leftovers(lab)
    # the crashed launcher registered its task with gateway and broker; reconcile deregisters
    assert after == EMPTY


def test_reconcile_removes_unrecorded_pieces(lab: Lab) -> None:
    s = lab.config.launcher
    tid = "abcdef0123"
    from stockade.launcher.addresses import slot_addresses

    a = slot_addresses(s.address_pool, 60)
    netns.create(f"{s.name_prefix}-{tid}", f"{s.name_prefix}{tid}", a)
    nft.run(nft.element_commands(s.nft_table, "add", [
        nft.Wiring(f"{s.name_prefix}{tid}", a.guest_ip, a.guest_mac, a.host_ip)]))
    CgroupSet(s.cgroup_root, s.cgroup_parent, tid).create(Limits(2**26, 16, 0.5))
    Path(s.scratch_dir, tid, "scratch").mkdir(parents=True)
    removed = lab.launcher.reconcile()
    assert removed["netns"] == [f"{s.name_prefix}-{tid}"]
    assert removed["cgroups"] == [tid] and removed["scratch"] == [tid]
    assert leftovers(lab) == EMPTY


def test_one_bad_record_does_not_stop_the_reconcile_of_others(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    """A corrupt record whose teardown raises (here a netns name that is null) is logged
    and left; the orphan after it is still removed, with its end event, and reconcile
    (which every run's start and the service's loop call) does not raise."""
    from stockade.launcher.addresses import slot_addresses
    from stockade.launcher.state import SandboxRecord

    s = lab.config.launcher
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid whose process is gone: both records are orphans

    def record(tid: str, slot: int) -> SandboxRecord:
        a = slot_addresses(s.address_pool, slot)
        return SandboxRecord(task_id=tid, profile="test", slot=slot,
                             ifname=f"{s.name_prefix}{tid}", netns=f"{s.name_prefix}-{tid}",
                             host_ip=a.host_ip, guest_ip=a.guest_ip, guest_mac=a.guest_mac,
                             owner_pid=dead.pid, scratch=str(Path(s.scratch_dir) / tid),
                             started_at=time.time() - 5, state="running")

    bad, good = record("bad0000001", 61), record("900d000001", 62)
    bad.netns = None  # type: ignore[assignment]
    a = slot_addresses(s.address_pool, 62)
    netns.create(good.netns, good.ifname, a)
    CgroupSet(s.cgroup_root, s.cgroup_parent, good.task_id).create(Limits(2**26, 16, 0.5))
    with lab.launcher.state.locked() as records:
        records[bad.task_id] = bad  # first: the old loop stopped here
        records[good.task_id] = good
    try:
        removed = lab.launcher.reconcile()
        assert removed["sandboxes"] == [good.task_id]
        assert good.task_id not in lab.launcher.state.read()
        assert not netns.exists(good.netns)
        ends = [e for e in lab.events(good.task_id) if e["stockade"].get("lifecycle") == "end"]
        assert [e["stockade"]["ended_by"] for e in ends] == ["orphaned"]
        assert bad.task_id in lab.launcher.state.read()  # kept for a later look, logged
        assert f"reconcile: sandbox {bad.task_id}: TypeError" in caplog.text
    finally:
        with lab.launcher.state.locked() as records:
            records.pop(bad.task_id, None)
            records.pop(good.task_id, None)
        netns.destroy(good.netns, good.ifname)
        CgroupSet(s.cgroup_root, s.cgroup_parent, good.task_id).remove()
    assert leftovers(lab) == EMPTY


def test_a_failed_claim_leaves_no_live_entry(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nft table cannot be made again while the record is claimed: the run fails and
    the launcher does not keep a live entry (that kill() and reconcile would trust)."""
    def fail(*_a: Any, **_k: Any) -> None:
        raise nft.NftError("table gone and cannot be made")

    monkeypatch.setattr(nft, "table_exists", lambda table: False)
    monkeypatch.setattr(nft, "apply_table", fail)
    with pytest.raises(nft.NftError):
        lab.run(["true"])
    assert lab.launcher._live == {}
    assert lab.launcher.list() == []
