"""The container tier: the command in its own mount/pid/ipc/uts namespaces inside the
sandbox's netns, `sandbox_init.py` as its pid 1, under the profile's seccomp filter."""

from __future__ import annotations

import contextlib
import functools
import marshal
import os
import select
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cgroups, initscript, netns
from ..environment import SANDBOX_PATH
from ..spec import LauncherError
from ..supervise import Ended, exit_status, watch
from . import CgroupControl, Live, StartContext, captures, init_plan, not_ready

if TYPE_CHECKING:  # annotations only
    from ..settings import LauncherSettings
    from ..spec import SandboxSpec

# a warm-pool init's setup (mounts, no command yet) takes tens of ms; on a loaded host
# seconds: past this it is taken for broken and the refill tears it down
POOLED_READY_TIMEOUT_S = 30.0


class NetnsBackend(CgroupControl):
    name = "netns"
    tap = None
    claims_inputs = True  # bound at the claim, before the init's pivot

    def create(self, live: Live, limits: Any, s: LauncherSettings) -> None:
        live.cg.create(cgroups.Limits(memory=limits.memory, pids=limits.pids,
                                      cpus=limits.cpus))

    def start(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        plan = {**initscript.build(init_plan(live, ctx)), "env": ctx.env,
                "seccomp": ctx.seccomp()}
        live.proc = _spawn_init(live, ctx, plan, list(spec.argv), (),
                                stdin=spec.stdin is not None)

    def start_pooled(self, live: Live, ctx: StartContext) -> None:
        """The init with every operation no task decides done, waiting for its claim."""
        ready_r, ready_w = os.pipe()
        claim_r, claim_w = os.pipe()
        try:
            plan = {**initscript.build_pooled(init_plan(live, ctx)), "ready_fd": ready_w,
                    "claim_fd": claim_r}
            live.proc = _spawn_init(live, ctx, plan, [], (ready_w, claim_r), stdin=True)
        except BaseException:
            os.close(claim_w)
            raise
        finally:
            os.close(ready_w)
            os.close(claim_r)
        live.pipes = claim_w  # the claim goes here; teardown closes it
        try:
            ready = select.select([ready_r], [], [], POOLED_READY_TIMEOUT_S)[0]
            ok = bool(ready) and os.read(ready_r, 1) == b"R"
        finally:
            os.close(ready_r)
        if not ok:
            raise LauncherError("a warm-pool sandbox's init did not finish its setup: "
                                + not_ready(live.proc, POOLED_READY_TIMEOUT_S))

    def claim_pooled(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        """Hand the waiting init its task: inputs, pivot, environment, filter, command."""
        claim = {"ops": initscript.claim_ops(init_plan(live, ctx)), "env": ctx.env,
                 "seccomp": ctx.seccomp(), "argv": list(spec.argv)}
        fd, live.pipes = live.pipes, None
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(marshal.dumps(claim, 4))
        except OSError as e:  # the init died while it waited: this sandbox is unusable
            raise LauncherError(f"the warm-pool sandbox is gone: {e.strerror or e}") from None

    def teardown(self, live: Live) -> None:
        if isinstance(live.pipes, int):  # an unclaimed warm-pool sandbox: its init ends
            with contextlib.suppress(OSError):
                os.close(live.pipes)
            live.pipes = None
        super().teardown(live)

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


def _spawn_init(live: Live, ctx: StartContext, plan: dict[str, Any], argv: list[str],
                fds: tuple[int, ...], *, stdin: bool) -> subprocess.Popen[bytes]:
    # the plan travels in a memfd, not argv: /proc/1/cmdline shows no host paths
    plan_fd = os.memfd_create("stockade-init-plan", 0)
    try:
        os.write(plan_fd, marshal.dumps(plan, 4))
        os.lseek(plan_fd, 0, os.SEEK_SET)
        cmd = ["nsenter", f"--net={netns.NETNS_DIR}/{live.record.netns}", "--",
               "unshare", "--mount", "--pid", "--ipc", "--uts", "--fork",
               "--kill-child", "--propagation", "private", "--",
               ctx.init_python, "-I", "-S", "-c", _init_source(), str(plan_fd), *argv]
        return subprocess.Popen(
            cmd, env={"PATH": SANDBOX_PATH},
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            close_fds=True, pass_fds=(plan_fd, *fds), start_new_session=True, cwd="/",
        )
    finally:
        os.close(plan_fd)


@functools.cache
def _init_source() -> str:
    return (Path(__file__).parent.parent / "sandbox_init.py").read_text()


BACKEND = NetnsBackend()
