"""The interface every sandbox backend implements, and the pieces they share.

A backend owns what differs between isolation tiers: the cgroup limits it sets, the
process it starts (the command under an init in namespaces, or QEMU), how it waits and
reads the outcome, and how it stops. Everything else (address, nft wiring, scratch,
registration, teardown of the shared pieces, events) is the launcher's. A new tier is a
module here with a `BACKEND` object; `backend_for` finds it by name.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from .. import initscript, rootfs, seccomp_bpf, trust
from ..spec import EndedBy, LauncherError
from ..supervise import Capture, feed_stdin, kill_proc, started

if TYPE_CHECKING:  # annotations only
    from .. import cgroups
    from ..addresses import SlotAddresses
    from ..execspec import ExecProc, ExecSpec
    from ..rootfs import Etc
    from ..settings import LauncherSettings
    from ..spec import SandboxSpec
    from ..state import SandboxRecord
    from ..supervise import Ended

NAMES = ("netns", "microvm", "gvisor")  # the modules of this package that hold a BACKEND


@dataclass
class Live:
    """A sandbox this launcher process runs."""

    record: SandboxRecord
    cg: cgroups.CgroupSet
    backend: Backend
    proc: subprocess.Popen[bytes] | None = None
    killed: threading.Event = field(default_factory=threading.Event)
    ended_as: EndedBy = "killed"  # the end an operator's kill gives it (session expiry: ttl)
    pipes: Any = None  # the backend's own handles (the microVM's output pipes)
    # the control sockets a registration may have reached: what its teardown deregisters
    registered: list[str] = field(default_factory=list)
    # a warm-pool sandbox's /etc (rootfs.Etc), made before any task: its claim's context
    warm_etc: Any = None
    ctx: StartContext | None = None  # what its start got: a session's execs need it again


@dataclass(frozen=True)
class StartContext:
    """What the launcher prepared for the backend's start."""

    settings: LauncherSettings
    addresses: SlotAddresses
    inputs: list[initscript.Bind]
    etc: Etc
    limits: Any  # the profile's
    env: dict[str, str]
    init_python: str  # the interpreter of the sandbox's init
    congestion_control: str | None
    seccomp: Callable[[], bytes]  # the profile's filter (LauncherError: none can be built)
    state_dir: Path  # the launcher's own state directory (caches)
    emit: Callable[[dict[str, Any]], None] | None = None  # the launcher's event writer
    # a microVM's fence self-test, run by the backend once its guest can run the probes
    # (with the guest's runner: probe list and timeout -> observations), before the
    # command; None: the tier was probed before its start, or the test was sampled out
    selftest: Callable[[Callable[[list[Any], float], dict[str, Any]]], None] | None = None


class Backend(Protocol):
    name: str
    tap: str | None  # a tap device for the sandbox's netns to create (None: veth only)

    def create(self, live: Live, limits: Any, s: LauncherSettings) -> None:
        """The sandbox's cgroups with this tier's limits (`limits`: the profile's)."""

    def start(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        """Start the sandbox's outermost process (`live.proc`); LauncherError when it
        cannot start (the caller tears down what exists)."""

    def wait(self, live: Live, spec: SandboxSpec, deadline: float,
             s: LauncherSettings) -> Ended:
        """Capture its output, stop it at `deadline`, on a kill or a limit; its outcome."""

    def kill(self, cg: cgroups.CgroupSet, proc: subprocess.Popen[bytes] | None) -> None: ...

    def suspend(self, cg: cgroups.CgroupSet) -> None: ...

    def resume(self, cg: cgroups.CgroupSet) -> None: ...

    def teardown(self, live: Live) -> None:
        """Reap the process and close the backend's handles (idempotent)."""

    def exec(self, live: Live, req: ExecSpec, ctx: StartContext) -> ExecProc:
        """One more command in a session sandbox (`SandboxSpec.session`), run exactly as
        its first command would be (uid, namespaces, cgroup, seccomp, environment)."""

    def configure(self, s: LauncherSettings) -> None:
        """Remember the settings its kill/suspend/resume need (they get only the cgroups)."""

    def discard(self, task_id: str, s: LauncherSettings) -> None:
        """Remove what the tier keeps of a sandbox outside its cgroups (any process's)."""

    def sweep(self, keep: set[str], s: LauncherSettings) -> list[str]:
        """Remove the tier's own leftovers of sandboxes no record keeps (reconcile)."""


class PooledBackend(Backend, Protocol):
    """A tier that keeps warm pools (launcher/pools.py); pools of a tier without these
    two are refused when the pool manager starts (`pooled`). A tier whose claim refuses
    inputs a cold start takes may have `check_claim(inputs)`, LauncherError for them:
    called before a pooled sandbox is taken for the task (the microVM tier)."""

    # False: a task with inputs never takes a pooled sandbox of this tier (it starts cold)
    claims_inputs: bool

    def start_pooled(self, live: Live, ctx: StartContext) -> None:
        """Start a sandbox that belongs to no task yet. Its cgroups (the pool's resource
        shape), netns, nft elements and scratch exist, and its address is registered as
        pooled (gateway, DNS firewall and broker deny it everything as `unclaimed`). Do
        the work no task decides (the container tier: every mount but the inputs; a
        microVM: a booted guest whose agent waits for its plan) and return once it is
        done with `live.proc` set, or raise LauncherError (the pool tears it down). `ctx`
        carries no task: its `inputs` and `env` are empty and its `seccomp` refuses."""

    def claim_pooled(self, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
        """Bind the sandbox to the task of `spec` (registered already); `ctx` is the
        task's, complete (inputs, environment, the profile's seccomp filter). Deliver the
        inputs read-only with the same discipline as `start` (nothing writable but the
        scratch), then start the command; `wait` follows as after `start`. A claimed
        sandbox is never pooled again: its teardown destroys it. LauncherError: the
        sandbox is unusable (the caller tears it down and starts the task cold)."""


class CgroupControl:
    """kill, suspend and resume through the sandbox's cgroups: every process in them."""

    def kill(self, cg: cgroups.CgroupSet, proc: subprocess.Popen[bytes] | None) -> None:
        cg.kill_all()
        if proc is not None:
            kill_proc(proc)

    def suspend(self, cg: cgroups.CgroupSet) -> None:
        cg.freeze(True)

    def resume(self, cg: cgroups.CgroupSet) -> None:
        cg.freeze(False)

    def teardown(self, live: Live) -> None:
        if live.proc is not None:
            kill_proc(live.proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                live.proc.wait(timeout=5)

    # the cgroups and the netns are the whole sandbox: nothing else to remember or remove
    def configure(self, s: LauncherSettings) -> None:
        pass

    def discard(self, task_id: str, s: LauncherSettings) -> None:
        pass

    def sweep(self, keep: set[str], s: LauncherSettings) -> list[str]:
        return []


def captures(proc: subprocess.Popen[bytes] | None, spec: SandboxSpec,
             s: LauncherSettings) -> tuple[Capture, Capture]:
    """The command's stdout and stderr captured from `proc`'s pipes, its stdin fed (the
    tiers whose outermost process has the command's stdio)."""
    assert proc is not None and proc.stdout is not None and proc.stderr is not None
    out = started(proc.stdout, s.max_output_bytes)  # type: ignore[arg-type]
    err = started(proc.stderr, s.max_output_bytes)  # type: ignore[arg-type]
    feed_stdin(proc, spec.stdin)
    return out, err


@functools.cache
def backend_for(name: str) -> Backend:
    if name not in NAMES:
        raise LauncherError(f"no {name} backend exists")
    return importlib.import_module(f"{__name__}.{name}").BACKEND  # type: ignore[no-any-return]


def backend_of(rec: SandboxRecord, s: LauncherSettings) -> Backend:
    """The backend a sandbox's record says it runs under (another process's sandbox), with
    this launcher's settings."""
    b = backend_for(rec.isolation if rec.isolation in ("microvm", "gvisor") else "netns")
    b.configure(s)
    return b


def init_plan(live: Live, ctx: StartContext) -> initscript.InitPlan:
    """The sandbox's filesystem and init as the container tier's init performs it; the
    gVisor tier builds its OCI bundle from the same plan."""
    s, etc = ctx.settings, ctx.etc
    base = Path(live.record.scratch)
    return initscript.InitPlan(
        root=str(base / "root"), scratch=str(base / "scratch"), etc_dir=str(base / "etc"),
        uid=s.sandbox_uid, gid=s.sandbox_gid,
        system=tuple(rootfs.system_binds(s.ro_binds)), inputs=tuple(ctx.inputs),
        etc_files=etc.names, host_etc=etc.host_etc,
        etc=() if etc.host_etc else tuple(rootfs.etc_binds(s.etc_allowlist)),
        etc_over=((trust.TRUST_BUNDLE_NAME, trust.DEFAULT_BUNDLE),) if etc.trust_vars else (),
        shm_size=s.shm_size, cgroup_procs=tuple(live.cg.procs_files()),
        rlimits=(("NOFILE", s.rlimit_nofile), ("CORE", s.rlimit_core),
                 ("MEMLOCK", s.rlimit_memlock)),
        congestion_control=ctx.congestion_control,
    )


def not_ready(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> str:
    """Why a warm-pool sandbox's process never reported ready: its stderr, or that it
    still hangs after `timeout_s`."""
    if proc is None or proc.poll() is None:
        return f"no answer within {timeout_s:.0f} s"
    err = proc.stderr.read().decode("utf-8", "replace").strip() if proc.stderr else ""
    return err[-500:] or f"exit status {proc.returncode}"


def pooled(backend: Backend) -> TypeGuard[PooledBackend]:
    """The tier keeps warm pools (has `start_pooled` and `claim_pooled`)."""
    return callable(getattr(backend, "start_pooled", None)) and callable(
        getattr(backend, "claim_pooled", None))


def launch(backend: Backend, live: Live, spec: SandboxSpec, ctx: StartContext) -> None:
    """Before the sandbox's fence and registration: a tier whose start can be held at a
    gate (`launch(live, spec, ctx)` True) starts booting now; `start` releases it."""
    early = getattr(backend, "launch", None)
    if callable(early):
        early(live, spec, ctx)


def seccomp_program(python: str, profile: Any) -> bytes:
    """The profile's seccomp program; without one no sandbox starts (fail closed)."""
    try:
        return seccomp_bpf.filter_for(python, profile)
    except seccomp_bpf.SeccompError as e:
        raise LauncherError(str(e)) from None


def pool_seccomp_program(python: str) -> bytes:
    """The program of a profile that relaxes no call: what a pooled microVM's command
    child loads before its claim (a claim whose profile's program differs gets a fresh
    child). The same bytes as `seccomp_program` gives such a profile (compiled once)."""
    return seccomp_program(python, None)
