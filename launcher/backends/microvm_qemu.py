"""QEMU's process for one microVM sandbox: its command line (cgroups, netns, pid and mount
namespaces around QEMU), the pipes its console and ports are read from, the agent's socket,
and a restore's monitor (the backend, launcher/backends/microvm.py, decides what to start)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .. import microvm, netns, vmimage, vmsnapshot
from ..environment import SANDBOX_PATH
from ..spec import LauncherError
from ..supervise import kill_proc
from ..vmexec import AgentLink
from . import Live, StartContext

# moves this shell into each cgroup.procs file given before "--", then execs the rest
_JOIN_CGROUPS = ('for f; do shift; [ "$f" = -- ] && break; echo 0 > "$f" || exit 125; done; '
                 'exec "$@"')

@dataclass
class VmPipes:
    """Read ends of the pipes QEMU writes the guest's console and ports into."""

    stdout: IO[bytes]
    stderr: IO[bytes]
    status: IO[bytes]
    console: IO[bytes]
    agent: AgentLink | None = None  # the guest agent's port (served in sessions)
    restored: bool = False  # started from a snapshot template
    restore_s: float | None = None  # how long QEMU took to load the template's state
    session: bool = False  # its guest serves execs through the agent

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        for f in (self.stdout, self.stderr, self.status, self.console):
            with contextlib.suppress(OSError):
                f.close()


def vm_spec(ctx: StartContext, cfg: Path, layout: microvm.Layout,
             machine: tuple[vmimage.Image, str, microvm.Accel], fds: list[int],
             agent_fd: int | None) -> microvm.VmSpec:
    """The VM of this sandbox; `fds`: where QEMU writes the console and the three ports."""
    s, vm, limits = ctx.settings, ctx.settings.microvm, ctx.limits
    image, qemu, accel = machine
    con, *ports = (f"/proc/self/fd/{fd}" for fd in fds)
    return microvm.VmSpec(
        qemu=qemu, accel=accel, kernel=image.kernel, initrd=image.initrd,
        memory_mib=microvm.guest_memory_mib(limits.memory, vm.guest_kernel_mib),
        cpus=microvm.vcpus(limits.cpus), mac=ctx.addresses.guest_mac, cfg_dir=str(cfg),
        layout=layout, console=con, ports=(ports[0], ports[1], ports[2]),
        tsc_khz=vmimage.tsc_khz(), tb_size_mib=vm.tb_size_mib,
        runas=(s.sandbox_uid, s.sandbox_gid) if vm.harden_qemu else None,
        run_with=vmimage.run_with(qemu), bios=vmimage.microvm_bios(),
        seccomp=vm.harden_qemu, agent_fd=agent_fd)


def spawn(live: Live, ctx: StartContext, cfg: Path, layout: microvm.Layout,
          machine: tuple[vmimage.Image, str, microvm.Accel], session: bool = False,
          snapshot: Path | None = None) -> socket.socket | None:
    """QEMU, its console and three ports on pipes the launcher reads, the agent port on one
    end of a socket pair (the other is the AgentLink's; every shape has it, so that its
    template does). Restored from `snapshot` when given (the guest goes on once it reads
    vmsnapshot.GO, written now): its QMP monitor's socket is returned."""
    pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(4)]
    ours, theirs = socket.socketpair()
    qmp = None
    with contextlib.ExitStack() as qemus:  # what QEMU has its copies of: closed here
        for _, w in pipes:
            qemus.callback(os.close, w)
        qemus.callback(theirs.close)
        try:
            passed = [w for _, w in pipes] + [theirs.fileno()]
            vspec = vm_spec(ctx, cfg, layout, machine, passed[:4], passed[4])
            if snapshot is not None:
                vspec, qmp = _restoring(vspec, snapshot, passed, qemus)
            live.proc = _popen(live, vspec, passed)
            if snapshot is not None:
                ours.sendall(vmsnapshot.GO)  # read once the restored guest runs
            live.pipes = VmPipes(*(os.fdopen(r, "rb") for r, _ in
                                   [pipes[1], pipes[2], pipes[3], pipes[0]]),
                                 agent=AgentLink(ours), restored=snapshot is not None,
                                 session=session)
        except BaseException:
            for r, _ in pipes:
                with contextlib.suppress(OSError):
                    os.close(r)
            for sock in (ours, qmp):
                if sock is not None:
                    sock.close()
            raise
    return qmp


def _restoring(vspec: microvm.VmSpec, snapshot: Path, passed: list[int],
               qemus: contextlib.ExitStack) -> tuple[microvm.VmSpec, socket.socket]:
    """`vspec` restored from `snapshot`, its monitor on a socket pair: (the spec, our end);
    QEMU's fds are added to `passed` and closed by `qemus`."""
    state_fd = os.open(snapshot, os.O_RDONLY | os.O_CLOEXEC)
    qemus.callback(os.close, state_fd)
    qmp, qmp_theirs = socket.socketpair()
    qemus.callback(qmp_theirs.close)
    passed += [state_fd, qmp_theirs.fileno()]
    return dataclasses.replace(vmsnapshot.restore_spec(vspec, state_fd),
                               qmp_fd=qmp_theirs.fileno()), qmp


def _popen(live: Live, vspec: microvm.VmSpec, passed: list[int]) -> subprocess.Popen[bytes]:
    try:
        qargv = microvm.qemu_argv(vspec)
    except ValueError as e:
        raise LauncherError(f"cannot start the microVM: {e}") from None
    return subprocess.Popen(
        _argv(live, qargv), env={"PATH": SANDBOX_PATH}, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True,
        pass_fds=tuple(passed), start_new_session=True, cwd="/")


def unspawn(live: Live) -> None:
    """QEMU ended and its handles closed (a restore that failed: the start goes on cold)."""
    if live.proc is not None:
        kill_proc(live.proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            live.proc.wait(timeout=10)
        if live.proc.stderr is not None:
            live.proc.stderr.close()
    if live.pipes is not None:
        live.pipes.close()
    live.proc = live.pipes = None


def _argv(live: Live, qargv: list[str]) -> list[str]:
    # QEMU joins the sandbox's cgroups before it allocates anything (a shell that
    # moves itself, then execs), then enters the netns, and runs as pid 1 of a pid
    # namespace of its own with its own /proc (it sees no host process; its end
    # ends the namespace) in a private mount namespace; the paths are arguments.
    # No chroot: QEMU 7.2's 9p server still resolves some operations (file
    # creation) by path, and the scratch share fails under -chroot
    return ["sh", "-c", _JOIN_CGROUPS, "sh", *live.cg.procs_files(), "--",
            "nsenter", f"--net={netns.NETNS_DIR}/{live.record.netns}", "--",
            "unshare", "--pid", "--fork", "--kill-child", "--mount",
            "--propagation", "private", "--mount-proc", "--", *qargv]
