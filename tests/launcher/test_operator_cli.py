"""`stockade sandbox kill|suspend|resume` without a Launcher (launcher/operator.py): the
same result as the in-process kill, with a live owner and with a dead one, and the
modules the command loads (checked on sys.modules, never on a timing)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from stockade.launcher import netns
from stockade.launcher.addresses import slot_addresses
from stockade.launcher.backends import NAMES, CgroupControl, backend_for
from stockade.launcher.cgroups import CgroupSet, Limits
from stockade.launcher.state import SandboxRecord

from .conftest import Lab
from .sessions_rig import host_leftovers

# what a kill of a sandbox whose owner runs must not import: the launcher, its backends
# (their start path), pools, claims, sessions, the isolation probes, the models of the
# configuration's other sections
NOT_LOADED = {"stockade.launcher.core", "stockade.launcher.backends",
              "stockade.launcher.claim", "stockade.launcher.pools",
              "stockade.launcher.sessions", "stockade.launcher.isolation",
              "stockade.launcher.fence", "stockade.launcher.cleanup", "stockade.config",
              "stockade.gateway.settings", "stockade.broker.settings"}


def test_every_backend_kills_through_its_cgroups() -> None:
    """operator.py kills through the cgroups alone, without importing the sandbox's
    backend: true while every backend's kill is CgroupControl's."""
    for name in NAMES:
        assert type(backend_for(name)).kill is CgroupControl.kill, name


# `sandbox list`, then the modules it loaded
LIST_CODE = ("import json, sys\nfrom stockade.cli import main\n"
             "assert main(['sandbox', 'list', *sys.argv[1:]]) == 0\n"
             "print(json.dumps(sorted(sys.modules)))")


def _cli(*argv: str) -> tuple[int, str, set[str]]:
    """`stockade ARGV` in a fresh interpreter: exit code, stderr, the modules it loaded."""
    code = ("import json, sys\nfrom stockade.cli import main\nrc = main(sys.argv[1:])\n"
            "print(json.dumps([rc, sorted(sys.modules)]))")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       timeout=60, check=False)
    rc, mods = json.loads(p.stdout.splitlines()[-1])
    return rc, p.stderr, set(mods)


def _config_file(lab: Lab, tmp: Path) -> Path:
    p = tmp / "stockade.yaml"
    p.write_text(yaml.safe_dump(lab.config.model_dump()))
    return p


def _ends(lab: Lab, tid: str) -> list[str]:
    return [e["stockade"]["ended_by"] for e in lab.events(tid)
            if e["stockade"].get("lifecycle") == "end"]


def _requests(lab: Lab, tid: str) -> list[str]:
    return [e["stockade"]["lifecycle"] for e in lab.events(tid)
            if e["message"].endswith(" requested")]


def test_kill_of_a_running_sandbox_loads_no_launcher(lab: Lab, tmp_path: Path) -> None:
    cfg = str(_config_file(lab, tmp_path))
    before = host_leftovers(lab.config.launcher)
    t, box = lab.background(["sleep", "60"])
    tid = box["task_id"]
    p = subprocess.run([sys.executable, "-c", LIST_CODE, "--config", cfg],
                       capture_output=True, text=True, timeout=60, check=True)
    *table, mods_line = p.stdout.splitlines()
    assert tid in "\n".join(table)
    assert not NOT_LOADED & set(json.loads(mods_line))
    for op in ("suspend", "resume"):
        rc, err, mods = _cli("sandbox", op, tid, "--config", cfg)
        assert rc == 0, err
        # the record's backend (gVisor pauses in its Sentry), nothing else of the launcher
        assert not (NOT_LOADED - {"stockade.launcher.backends"}) & mods, op
        assert lab.launcher.list()[0]["state"] == ("frozen" if op == "suspend" else "running")
    rc, err, mods = _cli("sandbox", "kill", tid, "--config", cfg)
    assert rc == 0, err
    assert not NOT_LOADED & mods
    # the kill returned once the owner had torn it down and written its end and its
    # signed record: the row is gone, both events are there, before its run returned
    assert tid not in lab.launcher.state.read()
    assert [e["stockade"]["lifecycle"] for e in lab.events(tid)][-2:] == ["end", "record"]
    t.join(timeout=20)
    assert box["result"].ended_by == "killed"
    assert _ends(lab, tid) == ["killed"]
    assert _requests(lab, tid) == ["suspend", "resume", "kill"]
    assert host_leftovers(lab.config.launcher) == before
    assert tid not in {x.task_id for x in lab.gateway_registry.tasks()}
    assert tid not in {x.task_id for x in lab.broker_registry.tasks()}
    rc, err, _ = _cli("sandbox", "kill", tid, "--config", cfg)
    assert rc == 1 and f"no sandbox {tid}" in err


@pytest.mark.parametrize("where", ["cli", "in-process"])
def test_kill_of_an_orphan_tears_it_down(lab: Lab, tmp_path: Path, where: str) -> None:
    """A sandbox whose launcher died: the kill tears it down itself, whether from the
    CLI or through Launcher.kill, with one end event `killed`."""
    s = lab.config.launcher
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid whose process is gone: nobody else will tear it down
    tid, slot = ("0ff0000001", 60) if where == "cli" else ("0ff0000002", 59)
    a = slot_addresses(s.address_pool, slot)
    rec = SandboxRecord(task_id=tid, profile="test", slot=slot, ifname=f"{s.name_prefix}{tid}",
                        netns=f"{s.name_prefix}-{tid}", host_ip=a.host_ip, guest_ip=a.guest_ip,
                        guest_mac=a.guest_mac, owner_pid=dead.pid,
                        scratch=str(Path(s.scratch_dir) / tid), started_at=time.time() - 5,
                        state="running")
    netns.create(rec.netns, rec.ifname, a)
    cg = CgroupSet(s.cgroup_root, s.cgroup_parent, tid)
    cg.create(Limits(2**26, 16, 0.5))
    with lab.launcher.state.locked() as records:
        records[tid] = rec
    try:
        if where == "cli":
            rc, err, _ = _cli("sandbox", "kill", tid, "--config",
                              str(_config_file(lab, tmp_path)))
            assert rc == 0, err
        else:
            assert lab.launcher.kill(tid)
        assert tid not in lab.launcher.state.read()
        assert not netns.exists(rec.netns) and not cg.exists()
        assert _ends(lab, tid) == ["killed"]
        assert _requests(lab, tid) == ["kill"]
    finally:
        with lab.launcher.state.locked() as records:
            records.pop(tid, None)
        netns.destroy(rec.netns, rec.ifname)
