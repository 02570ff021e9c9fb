"""The container tier: the command in its own mount/pid/ipc/uts namespaces inside the
sandbox's netns, `sandbox_init.py` as its pid 1, under the profile's seccomp filter."""

from __future__ import annotations

import functools
import marshal
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cgroups, initscript, netns
from ..environment import SANDBOX_PATH
from ..supervise import Ended, exit_status, watch
from . import CgroupControl, Live, StartContext, captures, init_plan

if TYPE_CHECKING:  # annotations only
    from ..settings import LauncherSettings
    from ..spec import SandboxSpec


class NetnsBackend(CgroupControl):
    name = "netns"
    tap = None

    def create(self, live: Live, limits: Any, s: LauncherSettings) -> None:
        live.cg.create(cgroups.Limits(memory=limits.memory, pids=limits.pids,
                                      cpus=limits.cpus))

    def start(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        bpf = ctx.seccomp()
        rec = live.record
        # the plan travels in a memfd, not argv: /proc/1/cmdline shows no host paths
        plan_fd = os.memfd_create("stockade-init-plan", 0)
        try:
            os.write(plan_fd, marshal.dumps({**initscript.build(init_plan(live, ctx)),
                                             "env": ctx.env, "seccomp": bpf}, 4))
            os.lseek(plan_fd, 0, os.SEEK_SET)
            argv = ["nsenter", f"--net={netns.NETNS_DIR}/{rec.netns}", "--",
                    "unshare", "--mount", "--pid", "--ipc", "--uts", "--fork",
                    "--kill-child", "--propagation", "private", "--",
                    ctx.init_python, "-I", "-S", "-c", _init_source(), str(plan_fd),
                    *spec.argv]
            live.proc = subprocess.Popen(
                argv, env={"PATH": SANDBOX_PATH}, stdin=subprocess.PIPE if spec.stdin is not None
                else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True, pass_fds=(plan_fd,), start_new_session=True, cwd="/",
            )
        finally:
            os.close(plan_fd)

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


@functools.cache
def _init_source() -> str:
    return (Path(__file__).parent.parent / "sandbox_init.py").read_text()


BACKEND = NetnsBackend()
