"""Session microVMs with real QEMU (TCG), netns, nftables and cgroups: the guest boots to its
agent, execs arrive over the agent's virtio-serial port and run exactly as a one-shot
guest's command does. One boot checks many things: each costs seconds under TCG."""

from __future__ import annotations

import contextlib
import json
import marshal
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
from polling import eventually
from stockade.launcher import LauncherError, SandboxSpec, vmexec
from stockade.launcher.backends import Live
from stockade.launcher.execspec import ExecSpec
from stockade.policy.model import Limits, Profile

from .conftest import Lab
from .test_launcher_leak import EMPTY, leftovers

pytestmark = [pytest.mark.netns, pytest.mark.slow]

PATH = "/usr/local/bin:/usr/bin:/bin"
# `selftest: sampled`, as the lab's profiles (it samples none: it has no real gateway)
VMS = Profile("vms", "a session microVM", isolation="microvm", selftest="sampled",
              limits=Limits(cpus=1.0, memory=64 * 2**20, disk=8 * 2**20, pids=64, ttl=600))
# what an exec sees of itself: the same facts test_launcher_microvm checks of a first command
SELF = r"""
import json, os
st = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "cwd": os.getcwd(),
    "env": dict(os.environ), "caps": [st[k].strip() for k in ("CapEff", "CapBnd", "CapPrm")],
    "nnp": st["NoNewPrivs"].strip(), "seccomp": st["Seccomp"].strip(),
    "cgroup": open("/proc/self/cgroup").read().strip(),
    "nofile": open("/proc/self/limits").read().count("Max open files"),
}))
"""
# the sandbox user against the agent's port: every virtio-serial device node, opened
PORT_PROBE = r"""
import errno, os, stat
out = {}
for n in sorted(os.listdir("/dev")):
    if n.startswith("vport"):
        st = os.stat("/dev/" + n)
        try:
            os.close(os.open("/dev/" + n, os.O_RDWR))
            r = "OPENED"
        except OSError as e:
            r = errno.errorcode[e.errno]
        out[n] = [oct(stat.S_IMODE(st.st_mode)), st.st_uid, r]
print(out)
"""


@contextlib.contextmanager
def started_session(lab: Lab, rules: Any, profile: str
                    ) -> Iterator[tuple[Live, dict[str, Any]]]:
    """A session sandbox of `profile`, killed at the end; the box gets its RunResult."""
    box: dict[str, Any] = {}
    known = {r["task_id"] for r in lab.launcher.list()}

    def go() -> None:
        try:  # a session needs no command (argv is ignored: check_spec wants one today)
            box["result"] = lab.launcher.run(SandboxSpec(profile, ["true"], session=True), rules)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    # the start returns once the agent is ready: the sandbox is "running" from then on
    new = eventually(lambda: [r for r in lab.launcher.list() if r["task_id"] not in known
                              and r["state"] == "running"] or "error" in box, timeout=240)
    if not isinstance(new, list):
        raise AssertionError(f"the session did not start: {box.get('error')}")
    tid = new[0]["task_id"]
    try:
        yield lab.launcher._live[tid], box
    finally:
        lab.launcher.kill(tid)
        t.join(timeout=60)


@pytest.fixture(scope="module")
def session(lab: Lab) -> Iterator[tuple[Live, dict[str, Any]]]:
    """A session microVM of its own profile: a TTL long enough for a slow boot and the
    module's execs."""
    with started_session(lab, session_rules(lab), "vms") as s:
        yield s


def session_rules(lab: Lab) -> Any:
    return types.SimpleNamespace(version="lab-1", profiles={**lab.ruleset.profiles, "vms": VMS})


def run(live: Live, argv: list[str], **kw: Any) -> tuple[int, str, str]:
    kw.setdefault("env", {"PATH": PATH})
    proc = live.backend.exec(live, ExecSpec(tuple(argv), **kw), None)  # type: ignore[arg-type]
    assert proc.stdout is not None and proc.stderr is not None
    err: list[bytes] = []
    t = threading.Thread(target=lambda: err.append(proc.stderr.read()))  # type: ignore[union-attr]
    t.start()
    out = proc.stdout.read()
    t.join(timeout=120)
    return proc.wait(timeout=120), out.decode(), err[0].decode()


def test_an_exec_runs_as_a_first_command_does(session: tuple[Live, dict[str, Any]]) -> None:
    live, _ = session
    rc, out, err = run(live, ["python3", "-c", SELF], env={"PATH": PATH, "FOO": "bar"})
    assert rc == 0, err
    me = json.loads(out)
    assert (me["uid"], me["gid"], me["groups"], me["cwd"]) == (65534, 65534, [], "/scratch")
    assert me["env"]["FOO"] == "bar"
    assert me["caps"] == ["0000000000000000"] * 3
    assert (me["nnp"], me["seccomp"]) == ("1", "2")  # no_new_privs, a seccomp filter
    assert me["cgroup"] == "0::/task"  # the cgroup with the profile's limits
    # exit status, stderr apart from stdout, stdin, cwd
    assert run(live, ["sh", "-c", "echo out; echo err >&2; exit 7"]) == (7, "out\n", "err\n")
    assert run(live, ["cat"], stdin=b"from stdin") == (0, "from stdin", "")
    assert run(live, ["cat"]) == (0, "", "")  # no stdin: EOF at once
    assert run(live, ["mkdir", "-p", "/scratch/sub"])[0] == 0
    assert run(live, ["pwd"], cwd="/scratch/sub") == (0, "/scratch/sub\n", "")
    # a command that cannot start: as a first command's, setpriv's 127 and why
    rc, _, err = run(live, ["/nonexistent"])
    assert rc == 127 and "nonexistent" in err, err
    # much output arrives whole, in order
    rc, out, _ = run(live, ["python3", "-c", "print('x' * 300000)"])
    assert (rc, len(out)) == (0, 300001)


def test_the_sandbox_user_cannot_open_the_agent_port(
        session: tuple[Live, dict[str, Any]]) -> None:
    live, _ = session
    rc, out, err = run(live, ["python3", "-c", PORT_PROBE])
    assert rc == 0, err
    ports = eval(out)  # noqa: S307 - a dict literal the probe printed
    agent = [n for n in ports if n.endswith("p4")]
    assert len(agent) == 1, ports
    assert ports[agent[0]] == ["0o600", 0, "EACCES"]
    # nor any other port: the command's output reaches the host only through the agent
    assert all(r == "EACCES" for _, _, r in ports.values()), ports


def test_the_agent_checks_what_it_is_asked(session: tuple[Live, dict[str, Any]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A cwd that resolves outside the scratch (a symlink the sandbox planted) is refused by
    the agent itself, past the launcher's own (lexical) check."""
    live, _ = session
    assert run(live, ["ln", "-sfn", "/etc", "/scratch/link"])[0] == 0
    monkeypatch.setattr(vmexec, "exec_payload", lambda req: marshal.dumps(
        {"argv": ["id"], "env": {}, "cwd": "/scratch/link", "stdin": False}, 4))
    rc, out, err = run(live, ["id"])
    assert (rc, out) == (126, "") and "not beneath /scratch" in err, err


def test_concurrent_execs_signals_and_kill(session: tuple[Live, dict[str, Any]],
                                           lab: Lab) -> None:
    live, box = session
    procs = [live.backend.exec(live, ExecSpec(("sh", "-c", f"sleep 1; echo {i}"),
                                              env={"PATH": PATH}), None)  # type: ignore[arg-type]
             for i in range(4)]
    assert [p.stdout.read() for p in procs] == [f"{i}\n".encode() for i in range(4)]  # type: ignore[union-attr]
    assert [p.wait(timeout=60) for p in procs] == [0] * 4
    # a kill ends the exec's process group (its children too), not the session
    p = live.backend.exec(live, ExecSpec(("sh", "-c", "sleep 600 & echo up; wait"),
                                         env={"PATH": PATH}), None)  # type: ignore[arg-type]
    assert p.stdout.readline() == b"up\n"  # type: ignore[union-attr]
    assert p.poll() is None
    p.kill()
    assert p.wait(timeout=60) == 137
    assert run(live, ["sh", "-c", "pgrep -x sleep || echo none"])[1] == "none\n"
    with pytest.raises(LauncherError, match="not beneath /scratch"):
        live.backend.exec(live, ExecSpec(("true",), cwd="/etc"), None)  # type: ignore[arg-type]
    # an exec still running when the session is killed ends with it
    p = live.backend.exec(live, ExecSpec(("sleep", "600"), env={"PATH": PATH}),
                          None)  # type: ignore[arg-type]
    assert lab.launcher.kill(live.record.task_id)
    assert p.wait(timeout=60) == 137
    with pytest.raises(LauncherError):
        live.backend.exec(live, ExecSpec(("true",), env={"PATH": PATH}), None)  # type: ignore[arg-type]
    eventually(lambda: "result" in box or "error" in box, timeout=60)
    assert box["result"].ended_by == "killed"
    assert leftovers(lab) == EMPTY
