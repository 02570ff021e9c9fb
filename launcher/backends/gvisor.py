"""The gVisor tier: the command under runsc (its Sentry is the syscall surface), started
inside the sandbox's netns with an OCI bundle built from the container tier's plan (the
pure parts are in launcher/gvisor.py). runsc never runs with a network in the host's
namespace: every start and probe enters a netns of the launcher's first (nsenter --net)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cgroups, gvisor, initscript, mounts, netns, nssysctl
from ..environment import SANDBOX_PATH
from ..spec import TASK_ID_RE, LauncherError
from ..supervise import Ended, exit_status, kill_proc, watch
from . import CgroupControl, Live, StartContext, captures, init_plan

if TYPE_CHECKING:  # annotations only
    from ..execspec import ExecProc, ExecSpec
    from ..settings import LauncherSettings
    from ..spec import SandboxSpec

# cgroup v1 hierarchies runsc makes <parent>/<id> in besides the launcher's own four
STAGED = "inputs-ro"  # <base>/inputs-ro/<n>: the inputs' read-only host binds
RUNSC_HIERARCHIES = ("blkio", "cpuacct", "cpuset", "devices", "systemd")
CALL_TIMEOUT_S = 15.0
# a session's first process in the container: it only keeps the container alive
SESSION_HOLDER = ("sleep", "infinity")
STATS_EVERY_S = 1.0  # `runsc events --stats` costs ~150 ms under load: at most this often


def state_root(s: LauncherSettings) -> str:
    """runsc's --root: one per nft table, so launchers on other tables never meet."""
    return os.path.join(s.gvisor.root_dir, s.nft_table)


def _call(argv: list[str], timeout: float = CALL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    # stdin/out never inherited: a sandbox runsc starts must not hold a pipe of ours
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, check=False, env={"PATH": SANDBOX_PATH})


@functools.cache
def _offered(runsc: str, timeout: float) -> frozenset[str]:
    try:
        p = _call([runsc, "flags"], timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LauncherError(f"runsc flags failed: {e}") from None
    return frozenset(gvisor.platforms(p.stdout + p.stderr))


def _probe(runsc: str, flags: list[str], prefix: str, timeout: float) -> bool:
    """`runsc run /bin/true` (a bundle of the host's root, read-only) in a throwaway netns
    of the launcher's naming; True on exit 0. `run`, not `do`: `do` makes a netns of its
    own for gVisor's netstack and so says nothing about the launcher's."""
    ns = f"{prefix}-gvprobe{os.getpid()}"
    if _call(["ip", "netns", "add", ns]).returncode != 0:
        return False
    try:
        with tempfile.TemporaryDirectory(prefix="stockade-runsc-probe-") as d:
            Path(d, "config.json").write_text(json.dumps(gvisor.probe_config()))
            # --ignore-cgroups: the probe makes no cgroups to leak
            return _call(["nsenter", f"--net={netns.NETNS_DIR}/{ns}", "--", runsc,
                          f"--root={d}/state", "--ignore-cgroups", "--overlay2=none", *flags,
                          "run", "--bundle", d, f"probe{os.getpid()}"],
                         timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        _call(["ip", "netns", "delete", ns])


@functools.cache
def _runtime(runsc: str, platform: str, network: str, prefix: str,
             timeout: float) -> tuple[str, str]:
    """(platform, network) runsc runs under here; probed once per launcher process."""
    offered = _offered(runsc, timeout)
    kvm_ok = platform == "kvm" and "kvm" in offered and _probe(
        runsc, ["--platform=kvm", "--network=none"], prefix, timeout)
    try:
        chosen = gvisor.platform_choice(platform, set(offered), kvm_ok)
    except ValueError as e:
        raise LauncherError(str(e)) from None
    if network == "auto":
        # gVisor's netstack refuses on kernels that show net.core sysctls in every netns
        ok = _probe(runsc, [f"--platform={chosen}", "--network=sandbox"], prefix, timeout)
        network = "sandbox" if ok else "host"
    return chosen, network


class GvisorBackend(CgroupControl):
    name = "gvisor"
    tap = None

    def __init__(self) -> None:
        # the settings of each launcher seen in this process, by its cgroup parent: kill,
        # suspend and resume get only the cgroups (whose parent names the launcher)
        self._settings: dict[str, LauncherSettings] = {}

    def configure(self, s: LauncherSettings) -> None:
        self._settings[s.cgroup_parent] = s

    def problem(self, s: LauncherSettings) -> str | None:
        """Why this host cannot run gvisor profiles (None: it can)."""
        self.configure(s)
        g = s.gvisor
        if not g.enabled:
            return "launcher.gvisor.enabled is false"
        if shutil.which(g.runsc) is None:
            return f"runsc ({g.runsc}) is not installed (scripts/bootstrap.sh installs it)"
        try:
            self.runtime(s)
        except LauncherError as e:
            return str(e)
        return None

    def runtime(self, s: LauncherSettings) -> dict[str, str]:
        g = s.gvisor
        runsc = shutil.which(g.runsc)
        if runsc is None:
            raise LauncherError(f"runsc ({g.runsc}) is not installed")
        platform, network = _runtime(runsc, g.platform, g.network, s.name_prefix,
                                     g.probe_timeout_s)
        return {"platform": platform, "network": network}

    def _flags(self, s: LauncherSettings) -> list[str]:
        rt = self.runtime(s)
        return gvisor.global_flags(shutil.which(s.gvisor.runsc) or s.gvisor.runsc,
                                   state_root(s), rt["platform"], rt["network"],
                                   s.gvisor.debug_log_dir)

    def create(self, live: Live, limits: Any, s: LauncherSettings) -> None:
        self.configure(s)
        live.cg.create(gvisor.host_limits(limits, s.gvisor))

    def start(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        s, rec = ctx.settings, live.record
        flags = self._flags(s)
        _netns_sysctls(rec.netns, ctx.congestion_control)
        base = Path(rec.scratch)
        plan = dataclasses.replace(init_plan(live, ctx), inputs=_stage_inputs(base, ctx.inputs))
        try:
            layout = gvisor.root_layout(plan, tuple(s.ro_binds))
            _materialize(base / "root", layout)
        except ValueError as e:
            raise LauncherError(f"cannot build the gVisor bundle: {e}") from None
        # a session's first process only holds the container (runsc needs one); its
        # commands come through exec
        argv = list(spec.argv) if spec.argv else list(SESSION_HOLDER)
        config = gvisor.oci_config(layout, str(base / "root"), argv, ctx.env, plan,
                                   ctx.limits.pids, f"/{s.cgroup_parent}/{rec.task_id}")
        fd = os.open(base / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        os.makedirs(state_root(s), mode=0o700, exist_ok=True)
        # `run`, not create + start: its exit status is the command's, its stdio the
        # command's pipes, and a killed `run` takes the sandbox with it
        live.proc = subprocess.Popen(
            ["nsenter", f"--net={netns.NETNS_DIR}/{rec.netns}", "--", *flags, "run",
             "--bundle", str(base), rec.task_id],
            env={"PATH": SANDBOX_PATH},
            stdin=subprocess.PIPE if spec.stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
            start_new_session=True, cwd="/")
        live.pipes = ctx.limits.pids  # the guest's NPROC: what wait's ceiling watches
        if spec.session:
            self._await_running(live, s)

    def _await_running(self, live: Live, s: LauncherSettings) -> None:
        """A session is ready once runsc reports its container running (an exec before
        that finds no container)."""
        end = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < end:
            assert live.proc is not None
            if live.proc.poll() is not None:
                raise LauncherError("runsc ended before the session's container ran")
            with contextlib.suppress(OSError, subprocess.TimeoutExpired, ValueError):
                p = _call([*self._flags(s), "state", live.record.task_id])
                if p.returncode == 0 and json.loads(p.stdout).get("status") == "running":
                    return
            time.sleep(0.01)
        raise LauncherError(f"the session's container was not running within "
                            f"{CALL_TIMEOUT_S} s")

    def wait(self, live: Live, spec: SandboxSpec, deadline: float,
             s: LauncherSettings) -> Ended:
        proc, cg = live.proc, live.cg
        out, err = captures(proc, spec, s)
        assert proc is not None
        ceiling = _Ceiling(self, s, live.record.task_id, cg, live.pipes or 0)
        ended_by = watch(proc, cg, live.killed, deadline, ceiling.hit)
        # killed while runsc was still starting, its sandbox and gofer (own session, our
        # pipes) may join the cgroups only now: kill them as they arrive, not at a timeout
        for _ in range(100):
            out.join(timeout=0.05)
            err.join(timeout=0.05)
            if not (out.is_alive() or err.is_alive()):
                break
            cg.kill_all()
        # exit 2 with failed host forks: the Sentry itself could not make a thread
        sentry_died = proc.returncode == 2 and cg.pids_failures() > 0
        return Ended(ended_by, exit_status(proc.returncode), ceiling.seen or sentry_died,
                     out, err)

    def exec(self, live: Live, req: ExecSpec, ctx: StartContext) -> ExecProc:
        """`runsc exec --process`: the OCI process of the container's first command (its
        user, rlimits, capabilities, no_new_privs, as config.json has them) with this
        command's argv, environment and cwd; the same global flags as every call."""
        rec = live.record
        with open(Path(rec.scratch) / "config.json") as f:
            process = json.load(f)["process"]
        process.update(args=list(req.argv), cwd=req.cwd,
                       env=[f"{k}={v}" for k, v in req.env.items()])
        process.pop("terminal", None)
        fd = os.memfd_create("stockade-exec-process", 0)
        pidfile = Path(rec.scratch) / f"exec-{secrets.token_hex(6)}.pid"
        try:
            os.write(fd, json.dumps(process).encode())
            os.lseek(fd, 0, os.SEEK_SET)
            proc = subprocess.Popen(
                [*self._flags(ctx.settings), "exec", f"--process=/proc/self/fd/{fd}",
                 f"--internal-pid-file={pidfile}", rec.task_id],
                env={"PATH": SANDBOX_PATH},
                stdin=subprocess.PIPE if req.stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
                pass_fds=(fd,), start_new_session=True, cwd="/")
        finally:
            os.close(fd)
        return _GuestExec(proc, self, ctx.settings, rec.task_id, pidfile)

    def guest_pids(self, s: LauncherSettings, task_id: str) -> int | None:
        """The Sentry's task count of a running sandbox (`runsc events --stats`)."""
        try:
            p = _call([*self._flags(s), "events", "--stats", task_id], 5)
        except (OSError, subprocess.TimeoutExpired, LauncherError):
            return None
        return gvisor.stats_pids(p.stdout) if p.returncode == 0 else None

    def _runsc(self, cg: cgroups.CgroupSet, command: str) -> subprocess.CompletedProcess[str]:
        """`runsc <flags> <command> <the sandbox's id>` with its launcher's flags."""
        s = self._settings.get(cg.parent)
        if s is None:
            raise LauncherError(f"no launcher settings for cgroup parent {cg.parent!r}")
        return _call([*self._flags(s), command, cg.name])

    # kill: the cgroups' (inherited). They hold the Sentry, the gofer and the stubs, and
    # SIGKILLing them ends `runsc run` at once; `runsc kill` would add a runsc start (tens
    # of ms, over a second under load) before anything dies. The state it leaves is
    # `delete -force`'s, at teardown.

    def suspend(self, cg: cgroups.CgroupSet) -> None:
        self._pause(cg, "pause")

    def resume(self, cg: cgroups.CgroupSet) -> None:
        self._pause(cg, "resume")

    def _pause(self, cg: cgroups.CgroupSet, what: str) -> None:
        # Sentry-internal: the host freezer stays thawed, `runsc state` says "paused"
        try:
            p = self._runsc(cg, what)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LauncherError(f"runsc {what} failed: {e}") from None
        if p.returncode != 0:
            raise LauncherError(f"runsc {what} failed: {p.stderr.strip()[-300:]}")

    def discard(self, task_id: str, s: LauncherSettings) -> None:
        """`delete -force`: idempotent; removes runsc's state and its own cgroup dirs. Then
        the staged inputs' mounts (before the scratch directory is removed)."""
        with contextlib.suppress(LauncherError, OSError, subprocess.TimeoutExpired):
            _call([*self._flags(s), "delete", "-force", task_id])
        _remove_state_files(s, lambda names: [n for n in gvisor.stale_state_files(names, set())
                                              if task_id in n])
        _remove_runsc_cgroups(s, task_id)
        _unstage(Path(s.scratch_dir, task_id))

    def sweep(self, keep: set[str], s: LauncherSettings) -> list[str]:
        if not os.path.isdir(state_root(s)) or shutil.which(s.gvisor.runsc) is None:
            return []
        try:
            p = _call([*self._flags(s), "list", "-format=json"])
            ids = gvisor.parse_list(p.stdout) if p.returncode == 0 else []
        except (OSError, subprocess.TimeoutExpired, LauncherError, ValueError):
            ids = []
        gone = gvisor.reconcile_ids(ids, keep)
        for tid in gone:
            self.discard(tid, s)
        _sweep_host(s, keep)
        return gone


class _GuestExec:
    """A `runsc exec` as an ExecProc; kill() ends the command inside the Sentry too (a
    SIGKILL of `runsc exec` alone would leave it running in the container)."""

    def __init__(self, proc: subprocess.Popen[bytes], backend: GvisorBackend,
                 s: LauncherSettings, task_id: str, pidfile: Path) -> None:
        self.proc, self.backend, self.s, self.task_id, self.pidfile = (
            proc, backend, s, task_id, pidfile)
        self.pid, self.stdin, self.stdout, self.stderr = (
            proc.pid, proc.stdin, proc.stdout, proc.stderr)

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None:
            self.pidfile.unlink(missing_ok=True)
        return rc

    def wait(self, timeout: float | None = None) -> int:
        rc = self.proc.wait(timeout)
        self.pidfile.unlink(missing_ok=True)
        return rc

    def kill(self) -> None:
        with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired,
                                 LauncherError):
            guest = int(self.pidfile.read_text().strip())
            _call([*self.backend._flags(self.s), "kill", f"--pid={guest}", self.task_id,
                   "KILL"])
        kill_proc(self.proc)


class _Ceiling:
    """The gVisor analogue of pids_fail_kill: the guest at its NPROC ceiling (the Sentry's
    task count, asked at most once a second while the host pids are high) twice in a row."""

    def __init__(self, backend: GvisorBackend, s: LauncherSettings, task_id: str,
                 cg: cgroups.CgroupSet, pids: int) -> None:
        self.backend, self.s, self.task_id, self.cg, self.pids = backend, s, task_id, cg, pids
        self.next_at = 0.0
        self.streak = 0
        self.seen = False

    def hit(self) -> bool:
        now = time.monotonic()
        # the host count holds runsc's own Go threads too (~60-70 idle): only well above
        # that can the guest be near its ceiling
        busy = self.pids + self.s.gvisor.pids_overhead // 2
        if self.pids <= 0 or now < self.next_at or self.cg.pids_current() < busy:
            return False
        self.next_at = now + STATS_EVERY_S
        n = self.backend.guest_pids(self.s, self.task_id)
        self.streak = self.streak + 1 if n is not None and n >= self.pids - 1 else 0
        self.seen = self.seen or self.streak >= 2
        return self.seen


def _stage_inputs(base: Path, inputs: list[initscript.Bind]) -> tuple[initscript.Bind, ...]:
    """Each input through a bind that is read-only in the host's kernel: runsc's gofer
    opens host files as root, and an open(O_TRUNC) of a host file the sandbox user may
    write (mode 0666) truncated it although the OCI mount says "ro" (runsc 20240729)."""
    if not inputs:
        return ()
    staged = base / STAGED
    staged.mkdir(mode=0o711)
    out = []
    for i, b in enumerate(inputs):
        target = staged / str(i)
        if b.is_dir:
            target.mkdir(mode=0o755)
        else:
            target.touch(mode=0o644)
        try:
            mounts.bind_ro(b.source, str(target))
        except OSError as e:
            raise LauncherError(f"cannot stage input {b.target}: {e.strerror}") from None
        out.append(dataclasses.replace(b, source=str(target)))
    return tuple(out)


def _unstage(base: Path) -> None:
    staged = base / STAGED
    with contextlib.suppress(OSError):
        for d in staged.iterdir():
            for _ in range(3):
                if not mounts.umount(str(d)):
                    break


def _netns_sysctls(ns: str, congestion_control: str | None) -> None:
    """What sandbox_init.py sets in the container tier, from the host: IPv6 off, ICMP
    sockets for everyone (nft still rejects them), the TCP default. Written in-process:
    two nsenter + sysctl(8) spawns cost 5-10 ms per start (more under load)."""
    path = f"{netns.NETNS_DIR}/{ns}"
    try:
        nssysctl.write(path, [("net.ipv6.conf.all.disable_ipv6", "1"),
                              ("net.ipv6.conf.default.disable_ipv6", "1"),
                              ("net.ipv4.ping_group_range", "0 2147483647")])
    except OSError as e:
        raise LauncherError(f"cannot set the sandbox's sysctls: {e}") from None
    if congestion_control:  # best effort: an algorithm the kernel lacks keeps the default
        with contextlib.suppress(OSError):
            nssysctl.write(path, [("net.ipv4.tcp_congestion_control", congestion_control)],
                           strict=False)


def _materialize(root: Path, layout: gvisor.RootLayout) -> None:
    """The bundle's root directory: only mount points and copied symlinks, root's, 0755;
    it is mounted read-only, so nothing here is ever written by the sandbox."""
    root.mkdir(mode=0o755, exist_ok=True)
    os.chmod(root, 0o755)  # noqa: S103 - the Sentry's gofer reads it as the sandbox user
    for guest in layout.dirs:
        os.makedirs(gvisor.confined(str(root), guest), mode=0o755, exist_ok=True)
    for guest in layout.files:
        p = gvisor.confined(str(root), guest)
        os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
        Path(p).touch(mode=0o644, exist_ok=True)
    for guest, target in layout.symlinks:
        p = gvisor.confined(str(root), guest)
        os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
        os.symlink(target, p)


def _sweep_host(s: LauncherSettings, keep: set[str]) -> None:
    """What runsc leaves on the host of containers no record keeps: cgroup dirs, staged
    input mounts, state files; with no record at all, the table's state root and the
    cgroup parents runsc made (each removed only once empty)."""
    for name in _runsc_cgroup_names(s):
        if name not in keep:
            _remove_runsc_cgroups(s, name)
    with contextlib.suppress(OSError):
        for d in Path(s.scratch_dir).iterdir():
            if d.name not in keep and TASK_ID_RE.match(d.name):
                _unstage(d)
    _remove_state_files(s, lambda names: gvisor.stale_state_files(names, keep))
    if not keep:
        with contextlib.suppress(OSError):
            Path(state_root(s)).rmdir()
        for h in RUNSC_HIERARCHIES:
            with contextlib.suppress(OSError):
                Path(s.cgroup_root, h, s.cgroup_parent).rmdir()


def _remove_state_files(s: LauncherSettings,
                        which: Callable[[list[str]], list[str]]) -> None:
    """runsc's files of gone containers (`delete -force` leaves the `.lock`)."""
    root = Path(state_root(s))
    with contextlib.suppress(OSError):
        for name in which(os.listdir(root)):
            (root / name).unlink(missing_ok=True)


def _runsc_cgroup_names(s: LauncherSettings) -> set[str]:
    names: set[str] = set()
    for h in RUNSC_HIERARCHIES:
        with contextlib.suppress(OSError):
            names.update(p.name for p in Path(s.cgroup_root, h, s.cgroup_parent).iterdir()
                         if p.is_dir())
    return names


def _remove_runsc_cgroups(s: LauncherSettings, task_id: str) -> None:
    """The dirs a runsc that died between create and delete leaves (v1 only); then the
    parents it made, once empty (a test launcher's own parent goes with its last sandbox)."""
    if cgroups.detect_version(s.cgroup_root) == 2:
        return
    for h in RUNSC_HIERARCHIES:
        parent = Path(s.cgroup_root, h, s.cgroup_parent)
        for d in (parent / task_id, parent):
            with contextlib.suppress(OSError):
                d.rmdir()


BACKEND = GvisorBackend()
