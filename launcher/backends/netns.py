"""The container tier: the command in its own mount/pid/ipc/uts namespaces inside the
sandbox's netns, `sandbox_init.py` as its pid 1, under the profile's seccomp filter."""

from __future__ import annotations

import contextlib
import functools
import marshal
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cgroups, initscript, netns
from ..environment import SANDBOX_PATH
from ..execserver import ExecServer
from ..spec import LauncherError
from ..supervise import Ended, exit_status, watch
from . import CgroupControl, Live, StartContext, captures, init_plan

if TYPE_CHECKING:  # annotations only
    from ..execspec import ExecProc, ExecSpec
    from ..settings import LauncherSettings
    from ..spec import SandboxSpec

# the init's -c program when its compiled code travels in the plan (sandbox_init.py
# takes the plan from PLAN then)
BOOTSTRAP = ("import marshal,sys\nwith open(int(sys.argv[1]),'rb') as f:\n"
             "    PLAN=marshal.loads(f.read())\nexec(marshal.loads(PLAN.pop('code')))\n")
COMPILE = ("import marshal,sys\nsys.stdout.buffer.write(marshal.dumps(compile("
           "sys.stdin.read(),'stockade-init','exec')))")
HELD_NAME = "stockade-held"  # = sandbox_init.py's HELD_NAME
READY_TIMEOUT_S = 30.0  # a session's init holds the sandbox within this (a loaded host)


class NetnsBackend(CgroupControl):
    name = "netns"
    tap = None

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one exec server per session, started once

    def create(self, live: Live, limits: Any, s: LauncherSettings) -> None:
        live.cg.create(cgroups.Limits(memory=limits.memory, pids=limits.pids,
                                      cpus=limits.cpus))

    def start(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        plan = {**initscript.build(init_plan(live, ctx)), "env": ctx.env,
                "seccomp": ctx.seccomp()}
        argv = ["nsenter", f"--net={netns.NETNS_DIR}/{live.record.netns}", "--",
                "unshare", "--mount", "--pid", "--ipc", "--uts", "--fork",
                "--kill-child", "--propagation", "private", "--"]
        live.proc = _spawn_init(argv, ctx.init_python, plan, spec.argv, spec.stdin is not None)
        if spec.session:
            _await_held(live)

    def exec(self, live: Live, req: ExecSpec, ctx: StartContext) -> ExecProc:
        """Through the session's exec server (`execserver.py`): `sandbox_init.py` again,
        with a plan that joins the running init's cgroups and namespaces once (no
        nsenter: the cgroups are host paths, joined before the mounts) and then starts
        each exec as the first command started (`start_command`)."""
        with self._lock:
            server = live.pipes
            if not isinstance(server, ExecServer) or not server.alive():
                plan = {**initscript.exec_plan(init_plan(live, ctx), _init_pid(live)),
                        "seccomp": ctx.seccomp()}
                server = live.pipes = ExecServer.spawn(lambda fd: _spawn_init(
                    [], ctx.init_python, {**plan, "serve": fd}, [], False, fd))
        _init_pid(live)  # refused once the session's init is gone
        return server.start(list(req.argv), req.env, req.cwd, req.stdin is not None)

    def teardown(self, live: Live) -> None:
        super().teardown(live)
        if isinstance(live.pipes, ExecServer):
            live.pipes.close()  # its process went with the sandbox's cgroups

    def wait(self, live: Live, spec: SandboxSpec, deadline: float,
             s: LauncherSettings) -> Ended:
        proc, cg = live.proc, live.cg
        out, err = captures(proc, spec, s)
        assert proc is not None

        def pids_hit() -> bool:
            return cg.pids_failures() >= s.pids_fail_kill

        ended_by = watch(proc, cg, live.killed, deadline, pids_hit)
        out.join(timeout=5)
        err.join(timeout=5)
        # a fork bomb whose shell died of a failed fork between two polls of the watch
        return Ended(ended_by, exit_status(proc.returncode), pids_hit(), out, err)


def _spawn_init(prefix: list[str], python: str, plan: dict[str, Any], argv: list[str],
                stdin: bool, *keep: int) -> subprocess.Popen[bytes]:
    # the plan travels in a memfd, not argv: /proc/1/cmdline shows no host paths; with
    # it the init's code, compiled once by that interpreter (compiling the source costs
    # each start and exec 5-25 ms)
    code = _init_code(python)
    plan_fd = os.memfd_create("stockade-init-plan", 0)
    try:
        os.write(plan_fd, marshal.dumps({**plan, "code": code} if code else plan, 4))
        os.lseek(plan_fd, 0, os.SEEK_SET)
        return subprocess.Popen(
            [*prefix, python, "-I", "-S", "-c", BOOTSTRAP if code else _init_source(),
             str(plan_fd), *argv],
            env={"PATH": SANDBOX_PATH},
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            close_fds=True, pass_fds=(plan_fd, *keep), start_new_session=True, cwd="/")
    finally:
        os.close(plan_fd)


def _held(pid: int) -> bool:
    """The session's init renames itself once every operation of its plan is done (the
    root pivoted, scratch mounted): from then on an exec may join it."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == HELD_NAME
    except OSError:
        return False


def _await_held(live: Live) -> None:
    end = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < end:
        with contextlib.suppress(LauncherError):
            if _held(_init_pid(live, held=False)):
                return
        if live.proc is not None and live.proc.poll() is not None:
            err = live.proc.stderr.read().decode(errors="replace") if live.proc.stderr else ""
            raise LauncherError(f"the session's init ended before it was ready: "
                                f"{err.strip()[-300:]}")
        time.sleep(0.002)
    raise LauncherError(f"the session's init was not ready within {READY_TIMEOUT_S} s")


def _init_pid(live: Live, *, held: bool = True) -> int:
    """The sandbox's init: the one child of `unshare --fork` (live.proc, which nsenter
    became); LauncherError once the sandbox is gone."""
    proc = live.proc
    if proc is None or proc.poll() is not None:
        raise LauncherError("the session's sandbox is not running")
    try:
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        kids = []
    if len(kids) != 1 or (held and not _held(int(kids[0]))):
        raise LauncherError("the session's init is not running")
    return int(kids[0])


@functools.cache
def _init_code(python: str) -> bytes | None:
    """sandbox_init.py compiled by `python` and marshalled (code objects are per Python
    version); None when that fails: the source is passed instead."""
    try:
        p = subprocess.run([python, "-I", "-S", "-c", COMPILE], input=_init_source().encode(),
                           capture_output=True, timeout=60, check=False,
                           env={"PATH": SANDBOX_PATH})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 and p.stdout else None


@functools.cache
def _init_source() -> str:
    return (Path(__file__).parent.parent / "sandbox_init.py").read_text()


BACKEND = NetnsBackend()
