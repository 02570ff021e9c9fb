"""The gVisor tier with real runsc: the command's I/O, its filesystem, its limits, start/kill
cycles and the reconciliation of what a crashed run leaves.
(The escape matrix, the fork bomb, the disk fill, kill, suspend/resume and the reconcile
after a launcher crash run over this tier in test_launcher_escapes.py,
test_launcher_limits.py and test_launcher_leak.py.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from polling import eventually
from stockade.launcher import RunResult, SandboxSpec, gvisor, netns, nft
from stockade.launcher.backends import gvisor as gvisor_backend
from stockade.launcher.cgroups import CgroupSet, leftover_names

from .conftest import Lab, gvisor_command_running
from .test_launcher_limits import _assert_clean

pytestmark = [pytest.mark.netns, pytest.mark.gvisor]
BACKEND = gvisor_backend.BACKEND


@pytest.fixture(autouse=True)
def _runsc(lab: Lab) -> None:
    why = BACKEND.problem(lab.launcher.s)
    if why is not None:
        pytest.skip(f"gVisor unavailable: {why}")


def runsc(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    s = lab.launcher.s
    return subprocess.run([*BACKEND._flags(s), *args], capture_output=True, text=True,
                          timeout=30, check=False)


def containers(lab: Lab) -> list[str]:
    return [c["id"] for c in json.loads(runsc(lab, "list", "-format=json").stdout or "null")
            or []]


def runsc_cgroups(lab: Lab) -> list[str]:
    s = lab.launcher.s
    return sorted(p.name for h in gvisor_backend.RUNSC_HIERARCHIES
                  if Path(s.cgroup_root, h, s.cgroup_parent).is_dir()
                  for p in Path(s.cgroup_root, h, s.cgroup_parent).iterdir())


def assert_gone(lab: Lab, res: RunResult) -> None:
    _assert_clean(lab, res)
    assert res.task_id not in containers(lab)
    assert res.task_id not in runsc_cgroups(lab)


def gv(lab: Lab, code: str, **kw: Any) -> RunResult:
    return lab.py(code, profile="gv", **kw)


def test_output_exit_code_stdin(lab: Lab) -> None:
    res = lab.run(["sh", "-c", "echo out; cat; echo err >&2; exit 7"], profile="gv",
                  stdin=b"fed\n")
    assert (res.exit_code, res.ended_by) == (7, "exit"), res.stderr
    assert res.stdout == "out\nfed\n" and res.stderr == "err\n"
    assert_gone(lab, res)


def test_start_event_names_the_tier_platform_and_network(lab: Lab) -> None:
    res = lab.run(["true"], profile="gv")
    start = lab.events(res.task_id)[0]["stockade"]
    assert start["lifecycle"] == "start" and start["isolation"] == "gvisor"
    assert start["gvisor"] == BACKEND.runtime(lab.launcher.s)
    assert start["gvisor"]["platform"] in ("systrap", "ptrace")
    assert start["gvisor"]["network"] in ("sandbox", "host")
    assert lab.launcher.list() == []


def test_identity_environment_and_etc(lab: Lab) -> None:
    res = gv(lab, "import ctypes, os, json\n"
             "st = dict(l.split(':\\t') for l in open('/proc/self/status').read()"
             ".splitlines() if ':\\t' in l)\n"
             "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(),"
             " 'caps': {k: st[k].strip() for k in"
             " ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb') if k in st},"
             " 'nnp': ctypes.CDLL(None).prctl(39, 0, 0, 0, 0), 'env': sorted(os.environ),"
             " 'etc': sorted(os.listdir('/etc')), 'root': sorted(os.listdir('/')),"
             " 'cwd': os.getcwd(), 'host': open('/etc/hostname').read().strip(),"
             " 'mounts': open('/proc/mounts').read()}))")
    assert res.exit_code == 0, res.stderr
    d = json.loads(res.stdout)
    assert (d["uid"], d["gid"], d["groups"]) == (65534, 65534, [])
    # (the Sentry's /proc shows no CapAmb line)
    assert {"CapPrm", "CapEff", "CapBnd"} <= set(d["caps"]), d["caps"]
    assert set(d["caps"].values()) == {"0000000000000000"} and d["nnp"] == 1  # PR_GET_NO_NEW_PRIVS
    assert not [k for k in d["env"] if k.lower().endswith("_proxy")]
    assert "STOCKADE_BROKER" in d["env"]
    assert {"passwd", "group", "hosts", "resolv.conf", "ssl"} <= set(d["etc"])
    assert not {"shadow", "sudoers", "machine-id", "fstab"} & set(d["etc"])
    assert not {"home", "root", "var", "run"} & set(d["root"])
    assert d["cwd"] == "/scratch" and d["host"] == "sandbox"
    s = lab.launcher.s
    for hidden in (s.scratch_dir, str(lab.tmp)):  # no host path shows in the mount table
        assert hidden not in d["mounts"]


def test_writes_refused_outside_scratch_and_inputs_read_only(lab: Lab, tmp_path: Path) -> None:
    data = tmp_path / "in"
    data.mkdir()
    (data / "f.txt").write_text("input\n")
    code = ("import errno\n"
            "def w(p):\n"
            "    try:\n        open(p, 'w').write('x'); return 'ok'\n"
            "    except OSError as e:\n        return errno.errorcode[e.errno]\n"
            "print(open('/inputs/in/f.txt').read().strip(),"
            " *[w(p) for p in ('/inputs/in/f.txt', '/usr/x', '/etc/passwd', '/x',"
            " '/scratch/ok', '/tmp/ok')])")
    res = lab.launcher.run(SandboxSpec("gv", ["python3", "-c", code],
                                       inputs=[(str(data), "/inputs/in")]), lab.ruleset)
    assert res.exit_code == 0, res.stderr
    words = res.stdout.split()
    assert words[0] == "input" and words[-2:] == ["ok", "ok"]
    assert all(w in ("EROFS", "EACCES") for w in words[1:5]), words
    assert (data / "f.txt").read_text() == "input\n"


def test_trust_bundle_visible(lab: Lab) -> None:
    res = gv(lab, "import os; p = os.environ.get('SSL_CERT_FILE', "
             "'/etc/ssl/certs/ca-certificates.crt'); print(os.path.getsize(p) > 0)")
    assert (res.exit_code, res.stdout.strip()) == (0, "True"), res.stderr


def test_cpu_limit_in_force_once_the_command_runs(lab: Lab) -> None:
    """runsc starts unthrottled; by the command's first instruction the prestart hook has
    put the profile's quota in force (read from the host, while the command runs)."""
    s = lab.launcher.s
    assert BACKEND.cpu_at_hook(s)  # runsc 20240729 runs prestart hooks
    thread, box = lab.background(["sleep", "30"], profile="gv")
    tid = box["task_id"]
    try:
        assert eventually(lambda: gvisor_command_running(lab, tid, "sleep"), timeout=20)
        path, value = CgroupSet(s.cgroup_root, s.cgroup_parent, tid).cpu_limit(1.0)
        assert Path(path).read_text().strip() == value  # the gv profile's 1.0 CPU
        config = json.loads(Path(s.scratch_dir, tid, "config.json").read_text())
        gate, *cpu = config["hooks"]["prestart"]  # the start gate first, then the limit
        assert gate == gvisor.start_gate_hook(str(Path(s.scratch_dir, tid, "start-gate")))
        assert cpu == gvisor.cpu_limit_hooks(path, value)["prestart"]
    finally:
        lab.launcher.kill(tid)
        thread.join(30)
    assert_gone(lab, box["result"])


def test_cpu_limit_that_does_not_land_fails_the_start(lab: Lab,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A quota the hook cannot read back (here: written to /dev/null) fails runsc's start
    before the command exists: nothing runs unthrottled, the error says why."""
    monkeypatch.setattr(CgroupSet, "cpu_limit", lambda self, cpus: ("/dev/null", "100000"))
    res = lab.run(["sh", "-c", "echo ran"], profile="gv")
    assert "ran" not in res.stdout
    assert res.exit_code != 0
    assert "the CPU limit 100000 did not land in /dev/null" in res.stderr, res.stderr
    assert_gone(lab, res)


def test_start_gate_holds_the_command_until_the_fence_holds(
        lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """runsc boots while the launcher fences and registers the sandbox, but its command
    waits at the start gate: a start that fails before the release (here: in the fence
    self-test, seconds after runsc began) never runs the command, and leaves nothing."""
    held: dict[str, Any] = {}
    check = lab.launcher.fence.check

    def failing_check(rec: Any, *args: Any, **kw: Any) -> Any:
        held["task_id"] = rec.task_id
        # runsc is at its prestart hooks within a second or two (longer under load); it
        # holds the container's lock meanwhile, so `runsc state`/`ps` would wait: the gate
        # hook is seen on the host, and the command's witness file in the scratch is not
        held["waiting"] = eventually(lambda: _gate_hook_waiting(
            str(Path(lab.launcher.s.scratch_dir, rec.task_id, "start-gate"))), timeout=30)
        held["ran"] = Path(lab.launcher.s.scratch_dir, rec.task_id, "scratch", "ran").exists()
        raise gvisor_backend.LauncherError("the fence did not hold (test)")

    monkeypatch.setattr(lab.launcher.fence, "check", failing_check)
    with pytest.raises(gvisor_backend.LauncherError, match="fence did not hold"):
        lab.launcher.run(SandboxSpec("gv", ["sh", "-c", "echo ran > /scratch/ran; sleep 30"]),
                         lab.ruleset)
    monkeypatch.setattr(lab.launcher.fence, "check", check)
    tid = held["task_id"]
    assert held["waiting"] and not held["ran"]
    s = lab.launcher.s
    assert not Path(s.scratch_dir, tid).exists()
    assert tid not in containers(lab) and tid not in runsc_cgroups(lab)
    assert tid not in leftover_names(s.cgroup_root, s.cgroup_parent)
    assert lab.launcher.list() == []


def _gate_hook_waiting(fifo: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path("/proc", pid, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"stockade-start-gate" in argv and fifo.encode() in argv:
            return True
    return False


def test_memory_bomb(lab: Lab) -> None:
    res = gv(lab, "b = []\nwhile True: b.append(bytearray(1 << 20))")
    # the host OOM killer takes the command's task inside the Sentry (the Sentry survives
    # and reports the command's failure, not a 137 as the other tiers do)
    assert res.ended_by == "limit" and res.exit_code != 0
    assert_gone(lab, res)


def test_ttl(lab: Lab) -> None:
    res = lab.launcher.run(SandboxSpec("gv", ["sh", "-c", "while :; do :; done"], ttl=2),
                           lab.ruleset)
    assert (res.ended_by, res.exit_code) == ("ttl", 137)
    assert_gone(lab, res)


def test_start_kill_cycles_leave_nothing(lab: Lab) -> None:
    s = lab.launcher.s
    for _ in range(int(os.environ.get("STOCKADE_GVISOR_CYCLES", "50"))):
        t, box = lab.background(["sleep", "60"], profile="gv")
        assert lab.launcher.kill(box["task_id"])
        t.join(timeout=30)
        assert box["result"].ended_by == "killed"
    assert containers(lab) == [] and runsc_cgroups(lab) == []
    root = gvisor_backend.state_root(s)
    assert not os.path.isdir(root) or os.listdir(root) == []  # no runsc state file left
    assert leftover_names(s.cgroup_root, s.cgroup_parent) == set()
    assert netns.list_netns(s.name_prefix) == [] and netns.list_links(s.name_prefix) == []
    assert not os.listdir(s.scratch_dir) and lab.launcher.list() == []
    elements = nft.list_elements(s.nft_table)
    assert not any(elements.get(k) for k in nft.PER_SANDBOX_SETS)
