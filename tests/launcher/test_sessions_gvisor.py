"""The gVisor tier's session execs through its exec server (launcher/gvisor_execd.py),
real runsc: an exec's kill ends every process it made (a forked grandchild, a setsid'd
one) and nothing of the other execs, also when the server hangs; the execs cannot reach
the server; an exec's identity is the first command's."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from polling import eventually

from . import sessions_rig
from .sessions_rig import Rig

rig = sessions_rig.rig

pytestmark = [pytest.mark.netns, pytest.mark.gvisor]

# three descendants of three kinds, then the exec's own first process waits
SPREAD = ("sleep 301 & (setsid sleep 302 &); sh -c 'sleep 303 &'; "
          "echo up; sleep 304")
# the other exec: no process of its own comes or goes while it waits
WAITER = ("import os, time\nwhile not os.path.exists('go'): time.sleep(0.05)\n"
          "print('a-done')")


@pytest.fixture
def gv(rig: Rig) -> Iterator[str]:
    from stockade.launcher.backends.gvisor import BACKEND

    why = BACKEND.problem(rig.svc.launcher.s)
    if why is not None:
        pytest.skip(f"gVisor unavailable: {why}")
    sid = rig.api.create("gv")["session_id"]
    try:
        yield sid
    finally:
        rig.api.kill(sid)


def guest_pids(rig: Rig, sid: str) -> dict[int, str]:
    """pid -> command of every process in the session's sandbox (`runsc ps`)."""
    out = runsc(rig, "ps", sid)
    return {int(r.split()[1]): r.split()[-1] for r in out.splitlines()[1:] if r.split()}


def runsc(rig: Rig, *args: str) -> str:
    from stockade.launcher.backends.gvisor import BACKEND

    return subprocess.run([*BACKEND._flags(rig.svc.launcher.s), *args], capture_output=True,
                          text=True, timeout=30, check=True).stdout


def background(rig: Rig, sid: str, argv: list[str],
               **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(rig.api.exec(sid, argv, **kw)))
    t.start()
    return t, box


def test_timeout_ends_every_process_of_the_exec_only(rig: Rig, gv: str) -> None:
    waiting, box = background(rig, gv, ["python3", "-c", WAITER])
    assert eventually(lambda: list(guest_pids(rig, gv).values()).count("python3") == 2,
                      timeout=30)  # the server and the waiter
    before = guest_pids(rig, gv)
    r = rig.api.exec(gv, ["sh", "-c", SPREAD], timeout_s=2)
    assert (r["ended_by"], r["exit_code"], r["stdout"]) == ("timeout", 137, "up\n"), r
    # none of its five processes is left; the other exec's are all there
    assert eventually(lambda: guest_pids(rig, gv) == before, timeout=10), (
        before, guest_pids(rig, gv))
    assert rig.api.exec(gv, ["touch", "go"])["exit_code"] == 0
    waiting.join(60)
    assert (box["exit_code"], box["stdout"]) == (0, "a-done\n"), box


def test_execs_cannot_signal_the_exec_server(rig: Rig, gv: str) -> None:
    assert rig.api.exec(gv, ["true"])["exit_code"] == 0
    (server,) = [p for p, c in guest_pids(rig, gv).items() if c == "python3"]
    r = rig.api.exec(gv, ["sh", "-c", f"kill -STOP {server}"])
    assert r["exit_code"] != 0 and "No such process" in r["stderr"], r


def test_kill_holds_when_the_exec_server_hangs(rig: Rig, gv: str) -> None:
    """A server that does not answer the kill (stopped here from the host): the exec's
    timeout ends its processes from the host (`runsc kill --pid` of its pid 1), and the
    server is replaced."""
    assert rig.api.exec(gv, ["true"])["exit_code"] == 0
    before = guest_pids(rig, gv)  # the session's holder and the exec server
    (server,) = [p for p, c in before.items() if c == "python3"]
    spread, box = background(rig, gv, ["sh", "-c", SPREAD], timeout_s=8)
    assert eventually(lambda: list(guest_pids(rig, gv).values()).count("sleep") == 5,
                      timeout=30)
    runsc(rig, "kill", f"--pid={server}", gv, "STOP")
    spread.join(60)
    assert (box["ended_by"], box["exit_code"]) == ("timeout", 137), box
    holder = {p: c for p, c in before.items() if c != "python3"}  # sh and its sleep
    assert eventually(lambda: guest_pids(rig, gv) == holder, timeout=10), (
        holder, guest_pids(rig, gv))
    assert rig.api.exec(gv, ["echo", "again"])["stdout"] == "again\n"


def test_exec_identity_is_the_first_commands(rig: Rig, gv: str) -> None:
    probe = ("grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' "
             "/proc/self/status; echo pid=$$")
    first = rig.api.exec(gv, ["sh", "-c", probe])
    assert first["exit_code"] == 0, first
    got = dict(ln.split(":", 1) for ln in first["stdout"].splitlines() if ":" in ln)
    assert {k: v.split() for k, v in got.items() if k in ("Uid", "Gid")} == {
        "Uid": ["65534"] * 4, "Gid": ["65534"] * 4}, got
    assert got["Groups"].strip() == ""
    caps = {k: v.strip() for k, v in got.items() if k.startswith("Cap")}
    assert caps and set(caps.values()) == {"0000000000000000"}, caps
    # pid 1 of a pid namespace of its own
    assert "pid=1" in first["stdout"].splitlines()
    missing = rig.api.exec(gv, ["no-such-command"])
    assert missing["exit_code"] == 127 and "no-such-command" in missing["stderr"], missing
