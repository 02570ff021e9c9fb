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
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import (
    cgroups,
    initscript,
    microvm,
    rootfs,
    scrub,
    vmimage,
    vminputs,
    vmprobes,
    vmsnapshot,
    vmtemplates,
)
from ..lifecycle import snapshot_fallback_event
from ..spec import LauncherError
from ..supervise import Ended, feed_stdin, kill_marker, kill_proc, started, watch
from ..vmexec import VmExec
from . import CgroupControl, Live, StartContext, pool_seccomp_program
from .microvm_qemu import VmPipes, spawn, unspawn, vm_spec

if TYPE_CHECKING:  # annotations only
    from ..execspec import ExecSpec
    from ..settings import LauncherSettings
    from ..spec import SandboxSpec

VM_CONSOLE_CAP = 64 * 1024  # the guest's console (kernel messages) kept for diagnostics
# a session's guest boots to its agent within this (seconds under TCG on a busy host)
AGENT_READY_TIMEOUT_S = 180.0
RESTORE_TIMEOUT_S = 60.0  # QEMU loads a template's state within this (a busy host, TCG)
# the guest-side modules a session guest's init loads from its plan
SESSION_MODULES = ("vmchannel", "guest_agent")
# a pooled guest's too: its wait for the claim, which may bring inputs (vminputs.py)
POOLED_MODULES = (*SESSION_MODULES, "guest_pool", "guest_inputs")
_ABS_PATH = re.compile(r"(?<![\w.])/[^\s,:;'\"()\[\]]+")


class MicrovmBackend(CgroupControl):
    name = "microvm"
    tap = microvm.TAP

    def __init__(self) -> None:
        # shapes started without a template: (a VmSpec of the shape, the image's stamp)
        self.missed: dict[str, tuple[microvm.VmSpec, str]] = {}
        self.templates = vmtemplates.Templates()

    def create(self, live: Live, limits: Any, s: LauncherSettings) -> None:
        vm = s.microvm
        # the host cgroup holds QEMU; the profile's memory, pids and CPU apply in the guest
        # (guest_init.py's cgroup of the command): QEMU's own share is its vCPUs, so the
        # guest's start and the emulation's work are not charged to the task's quota
        live.cg.create(cgroups.Limits(
            memory=microvm.host_memory_limit(
                limits.memory, limits.disk, vm.guest_kernel_mib, vm.vmm_overhead_mib,
                0 if vm.accel == "kvm" else vm.tb_size_mib),
            pids=vm.vmm_pids, cpus=float(microvm.vcpus(limits.cpus))))

    def start(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        """Raises LauncherError for anything that stops the VM from starting; the caller
        tears down what exists."""
        machine = _machine(ctx)
        cfg, layout, tables = _prepare(live, ctx)
        # a template of this shape saved earlier: restored instead of booted (vmsnapshot.py)
        shape = vm_spec(ctx, cfg, layout, machine, [0, 0, 0, 0], 0)
        snapshot = self._template(live, ctx, shape, machine[0].stamp)
        _write_cfg(cfg, spec, ctx, *tables, restored=snapshot is not None)
        if snapshot is not None and not self._restore(live, ctx, cfg, layout, machine,
                                                      spec.session, snapshot, shape):
            _write_cfg(cfg, spec, ctx, *tables)
            snapshot = None
        if snapshot is None:
            spawn(live, ctx, cfg, layout, machine, session=spec.session)
        if spec.session or ctx.selftest is not None:
            _await_agent(live)
        if ctx.selftest is not None:
            _selftest_in_guest(live, spec, ctx, ctx.selftest)

    def _template(self, live: Live, ctx: StartContext, shape: microvm.VmSpec,
                  stamp: str) -> Path | None:
        """The shape's template when it has a whole one; none yet: built in the background
        (this start boots cold, later ones restore)."""
        key = vmsnapshot.shape_key(shape, stamp)
        if not ctx.settings.microvm.snapshots:  # (build_templates can still save it)
            self.missed[key] = (shape, stamp)
            return None
        try:
            found = self.templates.lookup(ctx.state_dir, key)
        except vmtemplates.Bad as e:
            _fell_back(live, ctx, str(e))
            found = None
        if found is None:
            self.missed[key] = (shape, stamp)
            self.templates.build_later(shape, stamp, ctx.state_dir)
        return found

    def _restore(self, live: Live, ctx: StartContext, cfg: Path, layout: microvm.Layout,
                 machine: tuple[vmimage.Image, str, microvm.Accel], session: bool,
                 snapshot: Path, shape: microvm.VmSpec) -> bool:
        """QEMU restored from `snapshot`, running; False when QEMU refused the state (the
        template is removed, QEMU gone, an event says so: the caller boots cold)."""
        qmp = spawn(live, ctx, cfg, layout, machine, session=session, snapshot=snapshot)
        assert qmp is not None
        try:
            took = vmsnapshot.await_running(qmp, RESTORE_TIMEOUT_S)
            if isinstance(live.pipes, VmPipes):
                live.pipes.restore_s = took
            return True
        except (OSError, ValueError, vmsnapshot.SnapshotError) as e:
            unspawn(live)
            stamp = machine[0].stamp
            key = vmsnapshot.shape_key(shape, stamp)
            self.templates.drop(ctx.state_dir, key)
            _fell_back(live, ctx, f"QEMU did not restore the snapshot template: {e}")
            self.missed[key] = (shape, stamp)
            self.templates.build_later(shape, stamp, ctx.state_dir)  # anew
            return False
        finally:
            qmp.close()

    def build_templates(self, state_dir: Path) -> list[Path]:
        """Save the snapshot templates of the shapes that were booted cold so far (their
        later starts restore) and wait for them: tests and benchmarks."""
        done = []
        for key, (shape, stamp) in list(self.missed.items()):
            done.append(self.templates.build_now(shape, stamp, state_dir))
            self.missed.pop(key, None)
        return done

    # a pooled guest's shares are fixed when QEMU starts: the claim's plan carries the
    # inputs' bytes, which its init writes read-only (vminputs.py)
    claims_inputs = True

    def check_claim(self, inputs: list[initscript.Bind]) -> None:
        """What `claim_pooled` would refuse of the inputs (a device, a socket, the caps),
        from their metadata: before a pooled guest is taken for the task."""
        try:
            vminputs.check(inputs)
        except OSError as e:
            raise LauncherError(f"cannot read the inputs: {e.strerror or e}") from None
        except ValueError as e:
            raise LauncherError(str(e)) from None

    def start_pooled(self, live: Live, ctx: StartContext) -> None:
        """A guest that waits for its plan: restored from its shape's template (built
        first when there is none: a refill is off every task's path; a cold boot when none
        can be), it mounts its shares and starts its init, which loads what every task's
        guest loads, takes its slot's identity and address (denied as unclaimed; nothing
        in it sends), forks the command's child, which becomes the sandbox user and loads
        the filter of a profile that relaxes nothing (`pool_seccomp_program`), and waits
        on the agent port. `claim_pooled` sends the plan there."""
        machine = _machine(ctx)
        cfg, layout, tables = _prepare(live, ctx)
        a = ctx.addresses
        _write_files(cfg, ctx, microvm.pooled_plan(
            _session_modules(POOLED_MODULES), a.guest_ip, a.host_ip, a.prefixlen,
            microvm.fresh_identity(a.guest_mac, os.urandom(64), time.time()),
            _ahead(ctx), pool_seccomp_program(ctx.init_python),
            ctx.settings.microvm.pool_warmup, _task_locale(ctx.settings)), *tables)
        shape = vm_spec(ctx, cfg, layout, machine, [0, 0, 0, 0], 0)
        snapshot = self._pool_template(live, ctx, shape, machine[0].stamp)
        if snapshot is None or not self._restore(live, ctx, cfg, layout, machine, False,
                                                  snapshot, shape):
            spawn(live, ctx, cfg, layout, machine)
        vm = live.pipes
        assert isinstance(vm, VmPipes) and vm.agent is not None
        try:
            vmsnapshot.await_ready(vm.agent.sock, AGENT_READY_TIMEOUT_S, microvm.POOLED_READY)
        except (OSError, vmsnapshot.SnapshotError) as e:
            raise LauncherError(f"the pooled microVM did not start: {e}") from None

    def _pool_template(self, live: Live, ctx: StartContext, shape: microvm.VmSpec,
                       stamp: str) -> Path | None:
        if not ctx.settings.microvm.snapshots:
            return None
        try:
            self.templates.build_now(shape, stamp, ctx.state_dir)
        except (OSError, vmsnapshot.SnapshotError) as e:
            _fell_back(live, ctx, f"no snapshot template could be built: {e}")
            return None
        return self._template(live, ctx, shape, stamp)

    def claim_pooled(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        """The task's plan (with a fresh identity: MAC, entropy, clock; its stdin; its
        inputs' bytes) on the waiting guest's agent port: its init sets up the network,
        limits and inputs (said on the port: LauncherError with the guest's reason when it
        ends instead) and runs the command (or serves the session's execs)."""
        vm, proc = live.pipes, live.proc
        if not isinstance(vm, VmPipes) or vm.agent is None or proc is None or (
                proc.poll() is not None):
            raise LauncherError("the pooled microVM has ended")
        plan = _plan(spec, ctx, restored=True)
        plan["stdin_data"] = spec.stdin
        try:
            if ctx.inputs:
                plan["claim_inputs"] = vminputs.pack(ctx.inputs)
            frame = microvm.plan_frame(plan)
        except OSError as e:
            raise LauncherError(f"cannot read the inputs: {e.strerror or e}") from None
        except ValueError as e:
            raise LauncherError(str(e)) from None
        vm.session = spec.session
        try:
            vm.agent.sock.sendall(frame)
        except OSError as e:
            raise LauncherError(f"the pooled microVM is unreachable: {e}") from None
        if ctx.inputs:
            _await_inputs(live)
        # the fence self-test from inside the guest, as a cold start's (`start`)
        if spec.session or ctx.selftest is not None:
            _await_agent(live)
        if ctx.selftest is not None:
            _selftest_in_guest(live, spec, ctx, ctx.selftest)

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


def _prepare(live: Live, ctx: StartContext,
             stage_etc: bool = True) -> tuple[Path, microvm.Layout, tuple[str, str]]:
    """The guest's config share directory, its /etc (`stage_etc`), its layout with the
    mount and input tables."""
    base = Path(live.record.scratch)
    cfg = base / "cfg"
    cfg.mkdir(mode=0o755, exist_ok=True)
    os.chmod(cfg, 0o755)  # noqa: S103 - QEMU reads it after dropping to sandbox_uid
    if stage_etc and not ctx.etc.host_etc:  # the guest's /etc is this directory
        rootfs.stage_guest_etc(base / "etc", rootfs.etc_binds(ctx.settings.etc_allowlist),
                               bool(ctx.etc.trust_vars))
    layout, mount_table, input_table = _layout(base, ctx)
    return cfg, layout, (mount_table, input_table)


def _fell_back(live: Live, ctx: StartContext, why: str) -> None:
    logging.getLogger("stockade.launcher").warning("microVM %s: %s", live.record.task_id, why)
    if ctx.emit is not None:
        ctx.emit(snapshot_fallback_event(live.record, why))


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
    if spec.stdin is not None:
        (cfg / "stdin").write_bytes(spec.stdin)
    _write_files(cfg, ctx, _plan(spec, ctx, restored), mount_table, input_table)


def _write_files(cfg: Path, ctx: StartContext, plan: dict[str, Any], mount_table: str,
                 input_table: str) -> None:
    (cfg / "plan").write_bytes(microvm.encode_plan(plan))
    (cfg / "mounts").write_text(mount_table)
    (cfg / "inputs").write_text(input_table)
    (cfg / "python").write_text(ctx.settings.init_python + "\n")
    (cfg / "guest_init.py").write_text(_guest_init_source())
    for f in cfg.iterdir():
        os.chmod(f, 0o644)


def _ahead(ctx: StartContext) -> dict[str, Any]:
    """What a pooled guest of `ctx`'s shape puts in force before its claim: `_plan`'s
    values of microvm.AHEAD_KEYS (from the settings and the limits alone)."""
    s, limits = ctx.settings, ctx.limits
    return microvm.ahead(microvm.guest_plan(
        argv=["true"], env={}, uid=s.sandbox_uid, gid=s.sandbox_gid, rlimits=_rlimits(s),
        guest_ip="", host_ip="", prefixlen=0, memory=limits.memory, pids=limits.pids,
        pids_fail_kill=s.pids_fail_kill, stdin=False, cpus=limits.cpus,
        congestion_control=ctx.congestion_control))


def _task_locale(s: LauncherSettings) -> dict[str, str]:
    """The locale variables every task gets from the host's environment (`env_allowlist`,
    environment.sandbox_env; a caller's own may differ): its pool's warm-up runs under
    them, so a claim's start of the same program runs code already translated."""
    return {k: os.environ[k] for k in s.env_allowlist
            if (k == "LANG" or k.startswith("LC_")) and k in os.environ}


def _rlimits(s: LauncherSettings) -> dict[str, int]:
    return {"NOFILE": s.rlimit_nofile, "CORE": s.rlimit_core, "MEMLOCK": s.rlimit_memlock}


def _plan(spec: SandboxSpec, ctx: StartContext, restored: bool) -> dict[str, Any]:
    """guest_init.py's plan of the task (`restored`: with a fresh identity)."""
    s, a, limits = ctx.settings, ctx.addresses, ctx.limits
    return microvm.guest_plan(
        argv=list(spec.argv), env=ctx.env, uid=s.sandbox_uid, gid=s.sandbox_gid,
        rlimits=_rlimits(s), guest_ip=a.guest_ip, host_ip=a.host_ip, prefixlen=a.prefixlen,
        memory=limits.memory, pids=limits.pids, pids_fail_kill=s.pids_fail_kill,
        stdin=spec.stdin is not None, cpus=limits.cpus,
        congestion_control=ctx.congestion_control, seccomp=ctx.seccomp(),
        reserved=(*initscript.RESERVED, *s.ro_binds),
        session_modules=_session_modules() if spec.session or ctx.selftest is not None
        else None,
        probe_first=ctx.selftest is not None and not spec.session,
        fresh=microvm.fresh_identity(a.guest_mac, os.urandom(64), time.time())
        if restored else None)


def _session_modules(names: tuple[str, ...] = SESSION_MODULES) -> list[tuple[str, str]]:
    return [(m, _launcher_source(m)) for m in names]


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
        raise _guest_ended(live, str(e)) from None


def _await_inputs(live: Live) -> None:
    """Until the claimed guest's init says its inputs are mounted (exactly those bytes:
    what follows on the port is the agent's); LauncherError with the guest's reason when
    it ended first (the caller tears down, the pool refills)."""
    vm = live.pipes
    assert isinstance(vm, VmPipes) and vm.agent is not None
    sock, want, got = vm.agent.sock, vminputs.INPUTS_READY, b""
    sock.settimeout(AGENT_READY_TIMEOUT_S)
    try:
        while len(got) < len(want) and (chunk := sock.recv(len(want) - len(got))):
            got += chunk
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(None)
    if got != want:
        raise _guest_ended(live, "the pooled microVM did not take the inputs")


def _guest_ended(live: Live, what: str) -> LauncherError:
    """`what`, with the guest's own last words: QEMU ended (killed when it had not)."""
    vm, proc = live.pipes, live.proc
    assert isinstance(vm, VmPipes) and proc is not None
    kill_proc(proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    # the guest's init says why on its stderr port (QEMU has ended: the pipe ends)
    said = vm.stderr.read(4096).decode("utf-8", "replace").strip().splitlines()
    why = _ABS_PATH.sub("<host-path>", said[-1])[:300] if said else ""
    return LauncherError(f"{what}: {why}" if why else what)


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
