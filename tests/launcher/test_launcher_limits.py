"""Resource bombs, TTL, kill/suspend/resume, exports: each ends cleanly with `ended_by` set
and leaves the host as it was (no processes, cgroups, namespaces or scratch behind). The
fork bomb, the disk fill, kill and suspend/resume run in the container and the gVisor tier."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from polling import eventually
from stockade.launcher import RunResult, SandboxSpec
from stockade.launcher.cgroups import CgroupSet, leftover_names

from .conftest import Lab

pytestmark = pytest.mark.netns


def _assert_clean(lab: Lab, res: RunResult) -> None:
    s = lab.config.launcher
    assert res.task_id not in leftover_names(s.cgroup_root, s.cgroup_parent)
    assert not Path(s.scratch_dir, res.task_id).exists()
    assert not Path("/run/netns", f"{s.name_prefix}-{res.task_id}").exists()
    assert lab.launcher.list() == []
    ends = [e for e in lab.events(res.task_id) if e["stockade"].get("lifecycle") == "end"]
    assert ends[-1]["stockade"]["ended_by"] == res.ended_by


def test_fork_bomb(lab: Lab, tier: str) -> None:
    res = lab.run(["sh", "-c", "f() { f | f & }; f; sleep 20"], profile=tier)
    assert res.ended_by == "limit"
    _assert_clean(lab, res)
    ends = [e for e in lab.events(res.task_id) if e["stockade"].get("lifecycle") == "end"]
    assert ends[0]["event"]["reason"] == "resource_limit"


def test_memory_bomb(lab: Lab) -> None:
    res = lab.py("b = []\nwhile True: b.append(bytearray(1 << 20))")
    assert res.ended_by == "limit"
    assert res.exit_code == 137  # SIGKILL by the OOM killer
    _assert_clean(lab, res)


def test_disk_fill(lab: Lab, tier: str) -> None:
    res = lab.run(["sh", "-c", "dd if=/dev/zero of=/scratch/fill bs=1M count=64"], profile=tier)
    assert res.exit_code != 0
    assert "No space left" in res.stderr
    assert res.ended_by == "limit"
    _assert_clean(lab, res)


def test_infinite_loop_ttl(lab: Lab) -> None:
    res = lab.run(["sh", "-c", "while :; do :; done"], profile="short")
    assert res.ended_by == "ttl"
    _assert_clean(lab, res)
    ends = [e for e in lab.events(res.task_id) if e["stockade"].get("lifecycle") == "end"]
    assert ends[0]["event"]["reason"] == "ttl_expired"


def test_spec_ttl_is_capped_by_profile(lab: Lab) -> None:
    res = lab.launcher.run(SandboxSpec("short", ["sleep", "30"], ttl=3600), lab.ruleset)
    assert res.ended_by == "ttl"


def test_unread_stdin_does_not_stall_ttl(lab: Lab) -> None:
    spec = SandboxSpec("short", ["sleep", "30"], stdin=b"x" * (8 * 2**20))
    res = lab.launcher.run(spec, lab.ruleset)
    assert res.ended_by == "ttl"


def test_host_unaffected_after_bombs(lab: Lab) -> None:
    res = lab.run(["sh", "-c", "echo alive"])
    assert (res.exit_code, res.stdout, res.ended_by) == (0, "alive\n", "exit")


def test_kill(lab: Lab, tier: str) -> None:
    t, box = lab.background(["sleep", "60"], profile=tier)
    assert lab.launcher.kill(box["task_id"])
    t.join(timeout=20)
    res = box["result"]
    assert res.ended_by == "killed"
    _assert_clean(lab, res)
    assert lab.launcher.kill(box["task_id"]) is False  # idempotent: already gone


def _runsc_status(cg: CgroupSet) -> str:
    from stockade.launcher.backends.gvisor import BACKEND

    return str(json.loads(BACKEND._runsc(cg, "state").stdout)["status"])


def test_suspend_resume(lab: Lab, tier: str) -> None:
    t, box = lab.background(["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /scratch/n; "
                          "sleep 0.02; done"], profile=tier)
    tid = box["task_id"]
    counter = Path(lab.config.launcher.scratch_dir, tid, "scratch", "n")
    try:
        eventually(lambda: counter.exists() and counter.read_text().strip(), interval=0.01)
        assert lab.launcher.suspend(tid)
        s = lab.config.launcher
        cg = CgroupSet(s.cgroup_root, s.cgroup_parent, tid)
        if tier == "gv":  # runsc pause: inside the Sentry, the freezer cgroup stays thawed
            assert _runsc_status(cg) == "paused"
        elif cg.version == 1:
            eventually(lambda: (cg.dirs["freezer"] / "freezer.state").read_text().strip()
                       == "FROZEN", interval=0.01)
        assert [r["state"] for r in lab.launcher.list()] == ["frozen"]
        frozen_at = counter.read_text()
        time.sleep(0.3)  # the scenario: a while frozen, in which the counter would move
        assert counter.read_text() == frozen_at  # no progress while frozen
        assert lab.launcher.resume(tid)
        if tier == "gv":
            assert _runsc_status(cg) == "running"
        assert eventually(lambda: counter.read_text() not in (frozen_at, ""), interval=0.01)
    finally:
        lab.launcher.kill(tid)
        t.join(timeout=20)
    assert lab.launcher.suspend("0000000000") is False
    ops = [e["stockade"]["lifecycle"] for e in lab.events(tid)
           if e["event"]["action"] == "sandbox_lifecycle"]
    assert ops == ["start", "suspend", "resume", "kill", "end", "record"]


def test_exports_by_content(lab: Lab, tmp_path: Path) -> None:
    script = (
        "cd /scratch/out && echo hello > a.txt && echo '{\"k\": [1,2]}' > r.json && "
        "head -c 5000 /dev/zero | tr '\\0' 'x' > big.txt && "
        "printf '\\177ELF\\002\\001\\001\\000\\377' > fake.txt && "
        "ln -s /etc/passwd link.txt && mkdir sub && echo nested > sub/n.txt"
    )
    dest = tmp_path / "exp"
    res = lab.launcher.run(SandboxSpec("test", ["sh", "-c", script], export_dir=str(dest)),
                           lab.ruleset)
    assert res.exit_code == 0, res.stderr
    got = {e.name: (e.size, e.type) for e in res.exports}
    assert got == {"a.txt": (6, "text"), "r.json": (13, "json"), "sub/n.txt": (7, "text")}
    assert (dest / "a.txt").read_text() == "hello\n"
    assert sorted(os.listdir(dest)) == ["a.txt", "r.json", "stockade-record.json", "sub"]
    refused = {e["file"]["name"]: e["stockade"]["export"]["why"]
               for e in res.denials if e["event"]["action"] == "export_decision"}
    assert refused == {"big.txt": "too_large", "fake.txt": "type_not_allowed",
                       "link.txt": "not_regular"}
    assert all(e["event"]["reason"] == "export_refused" for e in res.denials
               if e["event"]["action"] == "export_decision")
