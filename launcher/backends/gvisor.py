"""The gVisor tier: the command under runsc (its Sentry is the syscall surface), started
inside the sandbox's netns with an OCI bundle built from the container tier's plan (the
pure parts are in launcher/gvisor.py). runsc never runs with a network in the host's
namespace: every start and probe enters a netns of the launcher's first (nsenter --net)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import marshal
import os
import select
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cgroups, gvisor, netns
from ..environment import SANDBOX_PATH
from ..gvisor_exec import GuestExecServer
from ..gvisor_waiter import READY
from ..spec import LauncherError
from ..supervise import Ended, exit_status, watch
from . import CgroupControl, Live, StartContext, captures, init_plan, not_ready
from . import gvisor_host as host
from .gvisor_host import RUNSC_HIERARCHIES, state_root  # noqa: F401 - re-exported

if TYPE_CHECKING:  # annotations only
    from ..execspec import ExecProc, ExecSpec
    from ..settings import LauncherSettings
    from ..spec import SandboxSpec

CALL_TIMEOUT_S = 15.0
# a session's first process in the container: it keeps the container alive and reaps
# what is reparented to it (dash's `wait` reaps any child: an exec whose server died)
SESSION_HOLDER = ("sh", "-c", "while :; do sleep 86400 & wait; done")
STATS_EVERY_S = 1.0  # `runsc events --stats` costs ~150 ms under load: at most this often
# a warm-pool sandbox's runsc start (no command yet) takes a few hundred ms, seconds under
# load: past this it is taken for broken and the refill tears it down
POOLED_READY_TIMEOUT_S = 60.0


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


def _probe(runsc: str, flags: list[str], prefix: str, timeout: float,
           config: dict[str, Any] | None = None) -> bool:
    """`runsc run /bin/true` (a bundle of the host's root, read-only; `config` instead of
    the plain probe's) in a throwaway netns of the launcher's naming; True on exit 0. `run`,
    not `do`: `do` makes a netns of its own for gVisor's netstack and so says nothing about
    the launcher's."""
    ns = f"{prefix}-gvprobe{os.getpid()}"
    if _call(["ip", "netns", "add", ns]).returncode != 0:
        return False
    try:
        with tempfile.TemporaryDirectory(prefix="stockade-runsc-probe-") as d:
            Path(d, "config.json").write_text(json.dumps(config or gvisor.probe_config()))
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


@functools.cache
def _prestart_hooks_run(runsc: str, flags: tuple[str, ...], prefix: str,
                        timeout: float) -> bool:
    """Whether this runsc runs OCI prestart hooks (one probe per launcher process): only
    then is a cgroup made without its CPU quota for the hook to put in force."""
    with tempfile.TemporaryDirectory(prefix="stockade-runsc-hook-") as d:
        stamp = os.path.join(d, "ran")
        ok = _probe(runsc, list(flags), prefix, timeout, gvisor.hook_probe_config(stamp))
        return ok and os.path.exists(stamp)


class GvisorBackend(CgroupControl):
    name = "gvisor"
    tap = None

    def __init__(self) -> None:
        # the settings of each launcher seen in this process, by its cgroup parent: kill,
        # suspend and resume get only the cgroups (whose parent names the launcher)
        self._settings: dict[str, LauncherSettings] = {}
        self._servers: dict[str, GuestExecServer] = {}  # a session's exec server, by task
        self._gates: dict[str, int] = {}  # a launched start's gate fd, by task, until teardown
        self._lock = threading.Lock()

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
        self.cpu_at_hook(s)  # its probe here, not in the first start
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

    def cpu_at_hook(self, s: LauncherSettings) -> bool:
        """True: the sandbox's CPU quota is put in force by config.json's prestart hook, so
        runsc's own start runs unthrottled (the cgroup is made without one)."""
        rt = self.runtime(s)
        return _prestart_hooks_run(shutil.which(s.gvisor.runsc) or s.gvisor.runsc,
                                   (f"--platform={rt['platform']}", f"--network={rt['network']}"),
                                   s.name_prefix, s.gvisor.probe_timeout_s)

    def create(self, live: Live, limits: Any, s: LauncherSettings) -> None:
        self.configure(s)
        live.cg.create(gvisor.host_limits(limits, s.gvisor), cpu_later=self.cpu_at_hook(s))

    def launch(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> bool:
        """runsc started before the sandbox is fenced and registered, its command held by
        the start gate (a prestart hook) until `start` releases it: the Sentry and the
        gofer boot (~150 ms) while the launcher adds the nft elements, registers the task
        and runs the fence self-test. False: this runsc runs no prestart hooks, so there is
        no gate and `start` starts it whole, after those steps."""
        if not self.cpu_at_hook(ctx.settings):
            return False
        fifo, fd = host.open_gate(Path(live.record.scratch))
        with self._lock:
            self._gates[live.record.task_id] = fd
        self._bundle(live, ctx, _first_process(spec), ctx.env, gate=fifo)
        self._run(live, ctx, stdin=spec.stdin is not None)
        return True

    def start(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        with self._lock:
            gate = self._gates.get(live.record.task_id)
        if gate is None:
            self._bundle(live, ctx, _first_process(spec), ctx.env)
            self._run(live, ctx, stdin=spec.stdin is not None)
        else:  # launched: the fence holds now, the command may start
            host.release_gate(gate)
        if spec.session:
            self._await_running(live, ctx.settings)

    # its mounts are fixed when runsc starts it: the claim copies the inputs into the
    # read-only root instead (gvisor_host.copy_inputs)
    claims_inputs = True

    def start_pooled(self, live: Live, ctx: StartContext) -> None:
        """runsc runs the bundle with `gvisor_waiter.py` as its process, which reports
        ready once the Sentry, the gofer and the root are up, then waits for its task."""
        self._bundle(live, ctx, [ctx.init_python, "-I", "-S", "-c", _waiter_source()],
                     {"PATH": SANDBOX_PATH})
        self._run(live, ctx, stdin=True)
        proc = live.proc
        assert proc is not None and proc.stdout is not None
        got = b""
        end = time.monotonic() + POOLED_READY_TIMEOUT_S
        while len(got) < len(READY) and time.monotonic() < end:
            if not select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))[0]:
                break
            chunk = os.read(proc.stdout.fileno(), len(READY) - len(got))
            if not chunk:
                break
            got += chunk
        if got != READY:
            raise LauncherError("a warm-pool gVisor sandbox did not get ready: "
                                + not_ready(proc, POOLED_READY_TIMEOUT_S))

    def claim_pooled(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        """The task's inputs copied into the sandbox's read-only root, then the waiter gets
        the task's command and environment and execs it."""
        if ctx.inputs:
            host.copy_inputs(Path(live.record.scratch) / "root", ctx.inputs,
                             tuple(ctx.settings.ro_binds))
        proc = live.proc
        assert proc is not None and proc.stdin is not None
        claim = marshal.dumps({"argv": _first_process(spec), "env": ctx.env}, 4)
        try:
            proc.stdin.write(len(claim).to_bytes(8, "big") + claim)
            proc.stdin.flush()
        except OSError as e:  # runsc or the waiter died while it waited
            raise LauncherError(f"the warm-pool sandbox is gone: {e.strerror or e}") from None
        if spec.session:  # its execs: `runsc exec` with the container's process settings
            self._await_running(live, ctx.settings)

    def _bundle(self, live: Live, ctx: StartContext, argv: list[str],
                env: dict[str, str], gate: str | None = None) -> None:
        """The OCI bundle of the container tier's plan (`ctx.inputs` staged read-only);
        `gate`: the start gate's FIFO, whose hook runs before the CPU limit's."""
        s, rec = ctx.settings, live.record
        host.netns_sysctls(rec.netns, ctx.congestion_control)
        base = Path(rec.scratch)
        plan = dataclasses.replace(init_plan(live, ctx), inputs=host.stage_inputs(base, ctx.inputs))
        try:
            layout = gvisor.root_layout(plan, tuple(s.ro_binds))
            host.materialize(base / "root", layout)
        except (ValueError, OSError) as e:
            raise LauncherError(f"cannot build the gVisor bundle: {e}") from None
        config = gvisor.oci_config(layout, str(base / "root"), argv, env, plan,
                                   ctx.limits.pids, f"/{s.cgroup_parent}/{rec.task_id}")
        if self.cpu_at_hook(s):
            config["hooks"] = gvisor.cpu_limit_hooks(*live.cg.cpu_limit(ctx.limits.cpus))
            if gate is not None:
                config["hooks"]["prestart"].insert(0, gvisor.start_gate_hook(gate))
        fd = os.open(base / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)

    def _run(self, live: Live, ctx: StartContext, *, stdin: bool) -> None:
        s, rec = ctx.settings, live.record
        flags = self._flags(s)
        os.makedirs(state_root(s), mode=0o700, exist_ok=True)
        # `run`, not create + start: its exit status is the command's, its stdio the
        # command's pipes, and a killed `run` takes the sandbox with it
        live.proc = subprocess.Popen(
            ["nsenter", f"--net={netns.NETNS_DIR}/{rec.netns}", "--", *flags, "run",
             "--bundle", rec.scratch, rec.task_id],
            env={"PATH": SANDBOX_PATH},
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
            start_new_session=True, cwd="/")
        live.pipes = ctx.limits.pids  # the guest's NPROC: what wait's ceiling watches

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
        """Through the session's exec server (`gvisor_execd.py`), started by one `runsc
        exec` on the first exec (and again if it died): each exec is then a spawn in the
        Sentry, in a pid namespace of its own, with the first command's identity."""
        with self._lock:
            server = self._servers.get(live.record.task_id)
            if server is None or not server.alive():
                if server is not None:
                    server.close()
                server = self._servers[live.record.task_id] = self._spawn_server(live, ctx)
        return server.start(list(req.argv), req.env, req.cwd, req.stdin is not None)

    def _spawn_server(self, live: Live, ctx: StartContext) -> GuestExecServer:
        rec, s = live.record, ctx.settings
        with open(Path(rec.scratch) / "config.json") as f:
            process = gvisor.execd_process(json.load(f)["process"], ctx.init_python,
                                           _execd_source(), SANDBOX_PATH)
        fd = os.memfd_create("stockade-execd-process", 0)
        pidfile = Path(rec.scratch) / "execd.pid"  # its pid in the sandbox
        pidfile.unlink(missing_ok=True)
        try:
            os.write(fd, json.dumps(process).encode())
            os.lseek(fd, 0, os.SEEK_SET)
            proc = subprocess.Popen(
                [*self._flags(s), "exec", f"--process=/proc/self/fd/{fd}",
                 f"--internal-pid-file={pidfile}", rec.task_id],
                env={"PATH": SANDBOX_PATH}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, close_fds=True, pass_fds=(fd,),
                start_new_session=True, cwd="/")
        finally:
            os.close(fd)

        def kill_pid(pid: int) -> None:
            p = _call([*self._flags(s), "kill", f"--pid={pid}", rec.task_id, "KILL"])
            if p.returncode != 0:
                raise LauncherError(f"runsc kill --pid={pid}: {p.stderr.strip()[-300:]}")
        return GuestExecServer(proc, kill_pid, pidfile)

    def teardown(self, live: Live) -> None:
        with self._lock:
            gate = self._gates.pop(live.record.task_id, None)
        if gate is not None:  # unreleased, its hook reads EOF and fails the start
            os.close(gate)
        super().teardown(live)
        with self._lock:
            server = self._servers.pop(live.record.task_id, None)
        if server is not None:
            server.close()  # its runsc exec went with the sandbox

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
        """`delete -force` where runsc left state (idempotent; removes runsc's state and its
        own cgroup dirs), then what is left of both and the staged inputs' mounts (before
        the scratch directory is removed)."""
        if host.state_left(s, task_id):
            with contextlib.suppress(LauncherError, OSError, subprocess.TimeoutExpired):
                _call([*self._flags(s), "delete", "-force", task_id])
        host.remove_state_files(s, lambda names: [n for n in gvisor.stale_state_files(names, set())
                                              if task_id in n])
        host.remove_runsc_cgroups(s, task_id)
        host.unstage(Path(s.scratch_dir, task_id))

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
        host.sweep_host(s, keep)
        return gone


@functools.cache
def _waiter_source() -> str:
    return (Path(__file__).parent.parent / "gvisor_waiter.py").read_text()


@functools.cache
def _execd_source() -> str:
    return (Path(__file__).parent.parent / "gvisor_execd.py").read_text()


def _first_process(spec: SandboxSpec) -> list[str]:
    """The container's first process: the command, or for a session one that only holds
    the container (runsc needs one); a session's commands come through exec."""
    return list(spec.argv) if spec.argv else list(SESSION_HOLDER)


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


BACKEND = GvisorBackend()
