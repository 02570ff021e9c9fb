"""The microVM tier: QEMU in the sandbox's netns and cgroups, its guest wired to the tap,
`guest_init.py` as the guest's init (the pure parts are in launcher/microvm.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .. import cgroups, initscript, microvm, netns, rootfs, scrub, vmimage, vmprobes, vmsnapshot
from ..environment import SANDBOX_PATH
from ..spec import LauncherError
from ..supervise import Ended, feed_stdin, kill_marker, kill_proc, started, watch
from ..vmexec import AgentLink, VmExec
from . import CgroupControl, Live, StartContext

if TYPE_CHECKING:  # annotations only
    from ..execspec import ExecSpec
    from ..settings import LauncherSettings
    from ..spec import SandboxSpec

VM_CONSOLE_CAP = 64 * 1024  # the guest's console (kernel messages) kept for diagnostics
# a session's guest boots to its agent within this (seconds under TCG on a busy host)
AGENT_READY_TIMEOUT_S = 180.0
# the guest-side modules a session guest's init loads from its plan
SESSION_MODULES = ("vmchannel", "guest_agent")
# moves this shell into each cgroup.procs file given before "--", then execs the rest
_JOIN_CGROUPS = ('for f; do shift; [ "$f" = -- ] && break; echo 0 > "$f" || exit 125; done; '
                 'exec "$@"')
_ABS_PATH = re.compile(r"(?<![\w.])/[^\s,:;'\"()\[\]]+")


@dataclass
class VmPipes:
    """Read ends of the pipes QEMU writes the guest's console and ports into."""

    stdout: IO[bytes]
    stderr: IO[bytes]
    status: IO[bytes]
    console: IO[bytes]
    agent: AgentLink | None = None  # the guest agent's port (served in sessions)
    restored: bool = False  # started from a snapshot template
    session: bool = False  # its guest serves execs through the agent

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        for f in (self.stdout, self.stderr, self.status, self.console):
            with contextlib.suppress(OSError):
                f.close()


class MicrovmBackend(CgroupControl):
    name = "microvm"
    tap = microvm.TAP

    def __init__(self) -> None:
        # shapes started without a template: (a VmSpec of the shape, the image's stamp)
        self.missed: dict[str, tuple[microvm.VmSpec, str]] = {}

    def create(self, live: Live, limits: Any, s: LauncherSettings) -> None:
        vm = s.microvm
        # the host cgroup holds QEMU; the profile's memory and pids apply in the guest
        live.cg.create(cgroups.Limits(
            memory=microvm.host_memory_limit(limits.memory, limits.disk,
                                             vm.guest_kernel_mib, vm.vmm_overhead_mib),
            pids=vm.vmm_pids, cpus=limits.cpus))

    def start(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        """Raises LauncherError for anything that stops the VM from starting; the caller
        tears down what exists."""
        machine = _machine(ctx)
        base = Path(live.record.scratch)
        cfg = base / "cfg"
        cfg.mkdir(mode=0o755)
        os.chmod(cfg, 0o755)  # noqa: S103 - QEMU reads it after dropping to sandbox_uid
        if not ctx.etc.host_etc:  # the guest's /etc is this directory
            rootfs.stage_guest_etc(base / "etc", rootfs.etc_binds(ctx.settings.etc_allowlist),
                                   bool(ctx.etc.trust_vars))
        layout, mount_table, input_table = _layout(base, ctx)
        # a template of this shape saved earlier: restored instead of booted (vmsnapshot.py)
        shape = _vm_spec(ctx, cfg, layout, machine, [0, 0, 0, 0], 0)
        key = vmsnapshot.shape_key(shape, machine[0].stamp)
        snapshot = vmsnapshot.find_template(ctx.state_dir, key)
        if snapshot is None:
            self.missed[key] = (shape, machine[0].stamp)
        _write_cfg(cfg, spec, ctx, mount_table, input_table, restored=snapshot is not None)
        _spawn(live, ctx, cfg, layout, machine, session=spec.session, snapshot=snapshot)
        if spec.session or ctx.selftest is not None:
            _await_agent(live)
        if ctx.selftest is not None:
            _selftest_in_guest(live, spec, ctx, ctx.selftest)

    def build_templates(self, state_dir: Path) -> list[Path]:
        """Save the snapshot templates of the shapes that were booted cold so far (their
        later starts restore): for pool refills and `stockade up`, off any start's path."""
        done = []
        for key, (shape, stamp) in list(self.missed.items()):
            done.append(vmsnapshot.ensure_template(shape, stamp, state_dir))
            self.missed.pop(key, None)
        return done

    def exec(self, live: Live, req: ExecSpec, ctx: StartContext) -> VmExec:
        """One exec through the session guest's agent (its plan already holds the uid,
        rlimits, seccomp filter and cgroup every exec runs under)."""
        vm = live.pipes
        if not isinstance(vm, VmPipes) or vm.agent is None or not vm.session:
            raise LauncherError("not a session sandbox: it runs no guest agent")
        return vm.agent.exec(req)

    def wait(self, live: Live, spec: SandboxSpec, deadline: float,
             s: LauncherSettings) -> Ended:
        proc, vm = live.proc, live.pipes
        assert proc is not None and proc.stderr is not None and isinstance(vm, VmPipes)
        console = started(vm.console, VM_CONSOLE_CAP)
        qemu_err = started(proc.stderr, VM_CONSOLE_CAP)  # type: ignore[arg-type]
        out = started(vm.stdout, s.max_output_bytes)
        err = started(vm.stderr, s.max_output_bytes)
        feed_stdin(proc, spec.stdin)
        # (a VM's host cgroup holds QEMU's threads; its guest counts its own pids)
        ended_by = watch(proc, live.cg, live.killed, deadline)
        for c in (out, err, console, qemu_err):
            c.join(timeout=5)
        killed = live.killed.is_set() or kill_marker(live.record.scratch).exists()
        exit_code, guest_limit, failed = vm_outcome(
            vm, proc.returncode, bytes(console.buf), bytes(qemu_err.buf),
            "killed" if killed else ended_by, live.cg.oom_kills() > 0, s.pids_fail_kill)
        return Ended(ended_by, exit_code, guest_limit, out, err, failed)

    def teardown(self, live: Live) -> None:
        super().teardown(live)
        if live.pipes is not None:
            live.pipes.close()


def _machine(ctx: StartContext) -> tuple[vmimage.Image, str, microvm.Accel]:
    """The guest image, QEMU and the accelerator this host gives it."""
    vm = ctx.settings.microvm
    try:
        image = vmimage.load_image(vm.image_dir)
    except ValueError as e:
        raise LauncherError(str(e)) from None
    qemu = vmimage.qemu_path(vm.qemu)
    if qemu is None:
        raise LauncherError(f"QEMU ({vm.qemu}) is not installed")
    accel = vmimage.resolve_accel(vm.accel, vm.qemu, image,
                                  ctx.state_dir / "microvm-accel.json", vm.probe_timeout_s)
    return image, qemu, accel


def _layout(base: Path, ctx: StartContext) -> tuple[microvm.Layout, str, str]:
    """The guest's shares, as a layout and its mount and input tables; file inputs are
    copied into one staged share (9p shares directories)."""
    s, staged = ctx.settings, base / "inputs"
    overlay = tuple(n for n in initscript.HOST_ETC_OVERLAY
                    if os.path.exists(os.path.join(rootfs.HOST_ETC, n)))
    try:
        layout, copies = microvm.guest_layout(
            system=rootfs.system_binds(s.ro_binds), etc_dir=str(base / "etc"),
            host_etc=ctx.etc.host_etc, host_etc_overlay=overlay, scratch=str(base / "scratch"),
            inputs=ctx.inputs, staged_dir=str(staged), shm_size=s.shm_size)
        tables = microvm.mount_table(layout), microvm.input_table(layout)
    except ValueError as e:
        raise LauncherError(f"cannot start the microVM: {e}") from None
    if copies:
        staged.mkdir(mode=0o755)
        for src, dest in copies:
            shutil.copyfile(src, dest)
            os.chmod(dest, 0o644)
    return layout, *tables


def _write_cfg(cfg: Path, spec: SandboxSpec, ctx: StartContext, mount_table: str,
               input_table: str, restored: bool = False) -> None:
    """The guest's configuration share: its plan, tables, stdin and init."""
    s, a, limits = ctx.settings, ctx.addresses, ctx.limits
    if spec.stdin is not None:
        (cfg / "stdin").write_bytes(spec.stdin)
    setpriv = _guest_setpriv(s.ro_binds)
    plan = microvm.guest_plan(
        argv=list(spec.argv), env=ctx.env, uid=s.sandbox_uid, gid=s.sandbox_gid,
        rlimits={"NOFILE": s.rlimit_nofile, "CORE": s.rlimit_core,
                 "MEMLOCK": s.rlimit_memlock},
        guest_ip=a.guest_ip, host_ip=a.host_ip, prefixlen=a.prefixlen,
        memory=limits.memory, pids=limits.pids, pids_fail_kill=s.pids_fail_kill,
        stdin=spec.stdin is not None, setpriv=setpriv,
        congestion_control=ctx.congestion_control, seccomp=ctx.seccomp(),
        reserved=(*initscript.RESERVED, *s.ro_binds),
        session_modules=[(m, _launcher_source(m)) for m in SESSION_MODULES]
        if spec.session or ctx.selftest is not None else None,
        probe_first=ctx.selftest is not None and not spec.session,
        fresh=microvm.fresh_identity(a.guest_mac, os.urandom(64), time.time())
        if restored else None)
    (cfg / "plan").write_bytes(microvm.encode_plan(plan))
    (cfg / "mounts").write_text(mount_table)
    (cfg / "inputs").write_text(input_table)
    (cfg / "python").write_text(s.init_python + "\n")
    (cfg / "guest_init.py").write_text(_guest_init_source())
    for f in cfg.iterdir():
        os.chmod(f, 0o644)


def _vm_spec(ctx: StartContext, cfg: Path, layout: microvm.Layout,
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
        seccomp=vm.harden_qemu, agent_fd=agent_fd)


def _spawn(live: Live, ctx: StartContext, cfg: Path, layout: microvm.Layout,
           machine: tuple[vmimage.Image, str, microvm.Accel], session: bool = False,
           snapshot: Path | None = None) -> None:
    """QEMU, its console and three ports on pipes the launcher reads, the agent port on one
    end of a socket pair (the other is the AgentLink's; every shape has it, so that its
    template does); restored from `snapshot` when given."""
    pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(4)]
    ours, theirs = socket.socketpair()
    passed = [w for _, w in pipes] + [theirs.fileno()]
    state_fd = None
    try:
        vspec = _vm_spec(ctx, cfg, layout, machine, passed[:4], passed[4])
        if snapshot is not None:
            state_fd = os.open(snapshot, os.O_RDONLY | os.O_CLOEXEC)
            passed.append(state_fd)
            vspec = vmsnapshot.restore_spec(vspec, state_fd)
        try:
            qargv = microvm.qemu_argv(vspec)
        except ValueError as e:
            raise LauncherError(f"cannot start the microVM: {e}") from None
        live.proc = subprocess.Popen(
            _argv(live, qargv), env={"PATH": SANDBOX_PATH}, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True,
            pass_fds=tuple(passed), start_new_session=True, cwd="/")
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
        ours.close()
        raise
    finally:  # QEMU has its copies
        for _, w in pipes:
            os.close(w)
        theirs.close()
        if state_fd is not None:
            os.close(state_fd)


def _selftest_in_guest(live: Live, spec: SandboxSpec, ctx: StartContext,
                       selftest: Callable[[Any], None]) -> None:
    """The fence self-test from inside the guest, through its agent, before the command
    (FenceUnverified: the caller tears the VM down). A one-shot guest then runs its
    command once the agent's port is closed; a session's agent goes on serving."""
    vm = live.pipes
    assert isinstance(vm, VmPipes) and vm.agent is not None
    selftest(functools.partial(vmprobes.run_in_guest, vm.agent, ctx.init_python))
    if not spec.session:
        vm.agent.close()


def _await_agent(live: Live) -> None:
    """Until the session guest's agent waits for execs; LauncherError with the guest's own
    words when it ended first (the caller tears down)."""
    vm, proc = live.pipes, live.proc
    assert isinstance(vm, VmPipes) and vm.agent is not None and proc is not None
    vm.agent.start()
    try:
        vm.agent.wait_ready(AGENT_READY_TIMEOUT_S,
                            lambda: proc.poll() is None and not live.killed.is_set())
    except LauncherError as e:
        kill_proc(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        # the guest's init says why on its stderr port (QEMU has ended: the pipe ends)
        said = vm.stderr.read(4096).decode("utf-8", "replace").strip().splitlines()
        why = _ABS_PATH.sub("<host-path>", said[-1])[:300] if said else ""
        raise LauncherError(f"{e}: {why}" if why else str(e)) from None


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


def vm_outcome(vm: VmPipes, qemu_rc: int, console: bytes, qemu_err: bytes, ended_by: str,
               host_oom: bool, pids_fail_kill: int) -> tuple[int, bool, str | None]:
    """(exit code, the guest hit a limit, why the VM failed or None) once QEMU is gone."""
    try:
        status = microvm.parse_status(vm.status.read(256).decode("ascii", "replace"))
    except OSError:
        status = None
    if status is not None:
        rc, ooms, pids = status
        return rc, ooms > 0 or pids >= pids_fail_kill, None
    if ended_by != "exit" or host_oom:  # killed by us, or QEMU by the host's OOM killer
        return 128 + signal.SIGKILL, host_oom, None
    # the guest never reported: QEMU could not start it, or the guest kernel died
    console_text = console.decode("utf-8", "replace")
    err_text = qemu_err.decode("utf-8", "replace").strip()
    logging.getLogger("stockade.launcher").warning(
        "microVM ended without a status (qemu exit %s): %s | console: %s",
        qemu_rc, err_text[-2000:], console_text[-2000:])
    why = (err_text.splitlines() or console_text.strip().splitlines() or
           [f"qemu exit status {qemu_rc}"])[-1]
    return 125, False, f"the microVM failed: {why[:500]}"


def _guest_setpriv(ro_binds: list[str]) -> str:
    """util-linux setpriv on a path the guest sees (the host's, through ro_binds)."""
    path = shutil.which("setpriv", path="/usr/bin:/bin")
    if path is None or not any(path.startswith(os.path.normpath(p) + "/") for p in ro_binds):
        raise LauncherError("the microVM guest needs util-linux setpriv under ro_binds")
    return path


def _guest_init_source() -> str:
    return _launcher_source("guest_init")


@functools.cache
def _launcher_source(module: str) -> str:
    """A guest-side module's source (they run in the guest, never imported here)."""
    return (Path(__file__).parent.parent / f"{module}.py").read_text()


def scrub_vm_error(text: str, scrubber: scrub.Scrubber, image_dir: str) -> str:
    """A failed microVM's reason (QEMU's last error line or the console's) for the caller:
    every absolute path (QEMU names its shares, kernel, fd paths) becomes <host-path>, then
    the sandbox's scrubbing (addresses, environment values, the host name; the image's
    directory too, in case a path hides in some other shape)."""
    text = _ABS_PATH.sub("<host-path>", text)
    extra = scrub.build(host_paths=[os.path.realpath(image_dir), image_dir])
    return scrub.scrub(scrub.scrub(text, scrubber), extra)


BACKEND = MicrovmBackend()
