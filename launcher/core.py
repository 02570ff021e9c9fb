"""The launcher: ephemeral sandboxes wired to the gateway and the broker, and nothing else.

`Launcher` is the Python API (the CLI and `stockade.stack` are thin callers). One sandbox =
netns + veth (address from the pool) + nft set elements (one transaction) + cgroups +
a size-capped scratch tmpfs + registrations with gateway and broker, then the command in
its own mount/pid/ipc/uts namespaces as an unprivileged user. Teardown undoes each piece
and tolerates pieces that are already gone, so kill, crash recovery and normal exit share it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import ipaddress
import logging
import marshal
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

from stockade.events import EventWriter, make_event
from stockade.events.taskstore import read_task_events, sweep
from stockade.procs import start_time
from stockade.tasks import ControlClient, ControlError, StateWriteError, Task

from . import (
    cgroups,
    exports,
    initscript,
    microvm,
    mounts,
    netns,
    nft,
    scrub,
    seccomp_bpf,
    trust,
    vmimage,
)
from .accounting import (
    await_reader_totals,
    denials_of,
    end_accounting,
    logged_in_store,
    unlogged_bypass_summary,
)
from .addresses import free_slot, slot_addresses
from .deregistration import DEREGISTERING, deregister, retry_pending, settle
from .ending import end_due, end_event
from .nflog import LogRecord, NflogSocket
from .state import SandboxRecord, StateFile

if TYPE_CHECKING:  # annotations only
    from .configview import LauncherConfig as Config
    from .settings import LauncherSettings

# orphaned: its `stockade run` died; a reconcile removed it (end events only)
EndedBy = Literal["exit", "ttl", "killed", "limit", "orphaned"]
TASK_ID_RE = re.compile(r"^[0-9a-f]{10}$")
HOST_ETC = "/etc"
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# removed from every sandbox's environment (whatever the allowlist or SandboxSpec.env say);
# a `proxy_env` profile then gets the launcher's own values for the first six
PROXY_ENV_NAMES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY",
                   "no_proxy", "ALL_PROXY", "all_proxy")


PROVIDED_ISOLATION = "container"  # what the netns backend gives (see `isolation`)
Backend = Literal["netns", "microvm"]


class LauncherError(RuntimeError):
    pass


def decide_backend(settings: LauncherSettings, profile_name: str, requested: str,
                   vm_problem: str | None) -> tuple[Backend, dict[str, str]]:
    """Which backend runs a profile, and the start event's isolation fields (pure).

    container -> netns; microvm -> the microVM backend when this host has it (`vm_problem`
    None), else netns only if `downgrade_isolation` accepts it; gvisor (no backend) likewise.
    LauncherError names the way out.
    """
    if requested == PROVIDED_ISOLATION:
        return "netns", {"isolation": PROVIDED_ISOLATION}
    if requested == "microvm" and vm_problem is None:
        return "microvm", {"isolation": "microvm"}
    if requested not in settings.downgrade_isolation:
        why = (f"the microVM backend is unavailable here: {vm_problem}"
               if requested == "microvm" else
               f"no {requested} backend exists; the netns backend gives "
               f"{PROVIDED_ISOLATION!r} only")
        raise LauncherError(
            f"profile {profile_name!r} asks for isolation {requested!r}; {why}. To run it "
            f"at {PROVIDED_ISOLATION} grade anyway, add {requested!r} to "
            "launcher.downgrade_isolation")
    return "netns", {"isolation": PROVIDED_ISOLATION, "isolation_requested": requested}


def microvm_problem(settings: LauncherSettings) -> str | None:
    """Why the microVM backend cannot run on this host (None: it can)."""
    vm = settings.microvm
    if not vm.enabled:
        return "launcher.microvm.enabled is false"
    return vmimage.host_problem(vm.image_dir, vm.qemu, settings.init_python)


def choose_backend(settings: LauncherSettings, profile: Any) -> tuple[Backend, dict[str, str]]:
    requested = getattr(profile, "isolation", PROVIDED_ISOLATION)
    problem = microvm_problem(settings) if requested == "microvm" else None
    return decide_backend(settings, profile.name, requested, problem)


def isolation_fields(settings: LauncherSettings, profile: Any) -> dict[str, str]:
    """The start event's isolation fields; LauncherError when the profile asks for a tier
    this host cannot give and the configuration does not accept a downgrade."""
    return choose_backend(settings, profile)[1]


def profile_of(ruleset: Any, name: str) -> Any:
    profile = ruleset.profiles.get(name)
    if profile is None:
        raise LauncherError(f"unknown profile {name!r}")
    return profile


def preflight(settings: LauncherSettings, ruleset: Any, profile_name: str) -> None:
    """What `run` would refuse about the profile, checked before any service starts."""
    isolation_fields(settings, profile_of(ruleset, profile_name))


class _ProfileLike(Protocol):
    name: str


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    profile: str
    argv: list[str]
    inputs: list[tuple[str, str]] = field(default_factory=list)  # (host path, guest path)
    export_dir: str | None = None
    ttl: int | None = None  # seconds; capped by the profile's limits.ttl
    env: dict[str, str] = field(default_factory=dict)
    stdin: bytes | None = None


@dataclass(frozen=True, slots=True)
class ExportedFile:
    name: str
    size: int
    type: str


@dataclass(slots=True)
class RunResult:
    task_id: str
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    denials: list[dict[str, Any]]
    exports: list[ExportedFile]
    ended_by: EndedBy
    timings: dict[str, float] = field(default_factory=dict)  # setup_s, run_s, teardown_s
    # the output cap (max_output_bytes) cut the stream; *_bytes: what the command wrote
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["exports"] = [asdict(e) for e in self.exports]
        return d


def _host_bind(path: str, target: str) -> initscript.Bind | None:
    """A read-only bind of a host path; a symlink is copied as a symlink (`/bin -> usr/bin`,
    `/etc/localtime`); None when the host lacks it."""
    if os.path.islink(path):
        return initscript.Bind(path, target, symlink_to=os.readlink(path))
    if os.path.exists(path):
        return initscript.Bind(path, target, is_dir=os.path.isdir(path))
    return None


def _port(listen: str) -> int:
    return int(listen.rsplit(":", 1)[1])


def proxy_listen_problem(proxy_listen: list[str]) -> str | None:
    """Why a `proxy_env` sandbox cannot use `gateway.proxy_listen`, or None (pure).

    The sandbox dials `<host-side veth address>:<port of proxy_listen[0]>` without any
    redirect, so the listener must be bound to every IPv4 address of the host: 0.0.0.0.
    """
    if not proxy_listen:
        return ("gateway.proxy_listen is empty: a proxy_env profile needs the gateway's "
                "explicit proxy listener on 0.0.0.0:<port>")
    listen = proxy_listen[0]
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "0.0.0.0":  # noqa: S104 - required: sandboxes reach it on their veth address
        return None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    what = "loopback only" if loopback else "not every IPv4 address of the host"
    return (f"gateway.proxy_listen[0] is {listen} ({what}): a proxy_env profile reaches the "
            "explicit proxy on the sandbox's host-side veth address, so the gateway must "
            f"listen on 0.0.0.0:{_port(listen)}")


class _Capture(threading.Thread):
    """Drains one pipe; keeps the first `cap` bytes, discards the rest (never blocks the child)."""

    def __init__(self, stream: IO[bytes], cap: int) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.cap = cap
        self.buf = bytearray()
        self.truncated = False
        self.total = 0  # every byte the command wrote, kept or not

    def run(self) -> None:
        while True:
            chunk = self.stream.read1(65536) if hasattr(self.stream, "read1") else b""
            if not chunk:
                break
            self.total += len(chunk)
            room = self.cap - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            if len(chunk) > max(room, 0):
                self.truncated = True
        self.stream.close()


@dataclass
class _Live:
    record: SandboxRecord
    cg: cgroups.CgroupSet
    proc: subprocess.Popen[bytes] | None = None
    killed: threading.Event = field(default_factory=threading.Event)
    vm: _VmPipes | None = None  # the microVM backend's output pipes (read ends)
    # the control sockets a registration may have reached: what its teardown deregisters
    registered: list[str] = field(default_factory=list)


@dataclass
class _VmPipes:
    """Read ends of the pipes QEMU writes the guest's console and ports into."""

    stdout: IO[bytes]
    stderr: IO[bytes]
    status: IO[bytes]
    console: IO[bytes]

    def close(self) -> None:
        for f in (self.stdout, self.stderr, self.status, self.console):
            with contextlib.suppress(OSError):
                f.close()


VM_CONSOLE_CAP = 64 * 1024  # the guest's console (kernel messages) kept for diagnostics


def _permitted_congestion_control(name: str | None) -> str | None:
    """`name` if a network namespace may make it its default, else None (with a warning):
    outside the initial namespace the kernel refuses what tcp_allowed_congestion_control
    does not list (reno is always allowed)."""
    if not name or name == "reno":
        return name
    try:
        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    except OSError:
        return name  # cannot tell: the init's write is best effort anyway
    if name in allowed:
        return name
    logging.getLogger("stockade.launcher").warning(
        "launcher.congestion_control %r is not in net.ipv4.tcp_allowed_congestion_control "
        "(%s): sandboxes keep the host's default", name, " ".join(allowed))
    return None


class Launcher:
    def __init__(
        self,
        config: Config,
        *,
        events: EventWriter | None = None,
        register: bool = True,
        nflog: bool = True,
    ) -> None:
        self.config = config
        self.s = config.launcher
        self.events = events or config.event_writer(stdout=False)
        self.register_tasks = register
        self.use_nflog = nflog
        self.state = StateFile(Path(config.state_dir) / "launcher" / f"{self.s.nft_table}.json")
        self.scratch_base = Path(self.s.scratch_dir)
        self.params = nft.TableParams(
            table=self.s.nft_table,
            transparent_port=_port(config.gateway.transparent_listen[0]),
            dns_port=_port(config.dns.listen[0]),
            broker_port=_port(config.broker.listen),
            nflog_group=self.s.nflog_group,
            log_rate=self.s.log_rate_per_s,
            proxy_port=(_port(config.gateway.proxy_listen[0])
                        if config.gateway.proxy_listen else None),
        )
        self._started = False
        self._start_lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._ifindex: dict[int, tuple[str, str]] = {}  # ifindex -> (task_id, profile)
        self._stop = threading.Event()
        self._nflog_thread: threading.Thread | None = None
        self._nflog_ticks = 0
        self._nflog_cv = threading.Condition()
        self.nflog_bound = False
        # per sandbox: NFLOG records this process's reader handled, dropped at its end or
        # by a reconcile (the nft bypass counter travels in SandboxRecord.bypass)
        self._logged: dict[str, int] = {}
        # sandboxes whose record this process's teardown removed and whose end event
        # (_end_accounting) is still to come: not ended as "gone elsewhere" meanwhile
        self._ending: set[str] = set()
        self._foreign_check = 0.0  # when the reader last looked for sandboxes gone elsewhere
        self.deregister_failures = 0  # failed deregistrations (each logged), retries too
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._congestion_control = _permitted_congestion_control(self.s.congestion_control)

    # -- lifecycle of the launcher itself ----------------------------------------------
    def start(self) -> None:
        """Install the nft table, reconcile leftovers of crashed runs, start the NFLOG reader."""
        with self._start_lock:
            if self._started:
                return
            mounts.private_dir(self.scratch_base)
            nft.apply_table(self.params)
            self.reconcile()
            sweep(self.config.task_events_dir, self.config.events.task_retention_s)
            if self.use_nflog:
                self._nflog_thread = threading.Thread(target=self._nflog_loop, daemon=True,
                                                      name="stockade-nflog")
                self._nflog_thread.start()
            self._started = True

    def close(self) -> None:
        self._stop.set()
        if self._nflog_thread is not None:
            self._nflog_thread.join(timeout=3)
        for tid in list(self._live):
            self.kill(tid)
        if self._started:
            # the last launcher out removes the table: a one-shot `stockade run` leaves
            # nothing behind; a concurrent _create() re-installs it under the same lock
            with self.state.locked() as records:
                if not records or all(r.state == DEREGISTERING for r in records.values()):
                    if nft.table_exists(self.s.nft_table):
                        nft.run(nft.delete_table_command(self.s.nft_table))
                    cgroups.remove_parent(self.s.cgroup_root, self.s.cgroup_parent)

    def __enter__(self) -> Launcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the public API ----------------------------------------------------------------
    def run(self, spec: SandboxSpec, ruleset: Any = None) -> RunResult:
        """Run one command in a fresh sandbox and tear it down; never leaves pieces behind."""
        profile = self._profile(spec.profile, ruleset)
        # refused before anything is set up
        backend, isolation = choose_backend(self.s, profile)
        self.start()
        policy_version = getattr(ruleset, "version", None)
        t0 = time.monotonic()
        live = self._create(spec, profile, policy_version, isolation, backend)
        rec = live.record
        t_setup = time.monotonic()
        ttl = rec.expires_at - time.time() if rec.expires_at else float(self.s.default_ttl_s)
        ended_by: EndedBy = "exit"
        out_cap = err_cap = None
        exit_code = -1
        vm_failed: str | None = None
        exported: list[ExportedFile] = []
        try:
            assert live.proc is not None
            proc = live.proc
            vm = live.vm
            console_cap = qemu_err = None
            if vm is not None:
                out_cap = _Capture(vm.stdout, self.s.max_output_bytes)
                err_cap = _Capture(vm.stderr, self.s.max_output_bytes)
                console_cap = _Capture(vm.console, VM_CONSOLE_CAP)
                console_cap.start()
                assert proc.stderr is not None
                qemu_err = _Capture(proc.stderr, VM_CONSOLE_CAP)  # type: ignore[arg-type]
                qemu_err.start()
            else:
                assert proc.stdout is not None and proc.stderr is not None
                out_cap = _Capture(proc.stdout, self.s.max_output_bytes)  # type: ignore[arg-type]
                err_cap = _Capture(proc.stderr, self.s.max_output_bytes)  # type: ignore[arg-type]
            out_cap.start()
            err_cap.start()
            if proc.stdin is not None:
                # fed from a thread: a command that never reads must not stall the TTL
                threading.Thread(target=_feed, args=(proc.stdin, spec.stdin or b""),
                                 daemon=True).start()
            deadline = time.monotonic() + max(ttl, 0.0)
            limits_pids_fail = self.s.pids_fail_kill
            # a pidfd wakes the loop the moment the sandbox ends (no polling delay)
            pidfd = os.pidfd_open(proc.pid)
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while True:
                if poller.poll(50) and proc.poll() is not None:
                    break
                if proc.poll() is not None:
                    break
                if live.killed.is_set():  # also when kill() came before the process existed
                    ended_by = "killed"
                    live.cg.kill_all()
                    self._kill_proc(proc)
                elif time.monotonic() >= deadline:
                    ended_by = "ttl"
                    live.cg.kill_all()
                    self._kill_proc(proc)
                elif vm is None and live.cg.pids_failures() >= limits_pids_fail:
                    # (a VM's host cgroup holds QEMU's threads; its guest counts its own)
                    ended_by = "limit"
                    live.cg.kill_all()
                    self._kill_proc(proc)
            os.close(pidfd)
            # the namespace's init is gone: every process in it is gone with it
            live.cg.kill_all()
            out_cap.join(timeout=5)
            err_cap.join(timeout=5)
            rc = proc.returncode
            exit_code = 128 - rc if rc < 0 else rc
            guest_limit = False
            if vm is not None:
                assert console_cap is not None and qemu_err is not None
                console_cap.join(timeout=5)
                qemu_err.join(timeout=5)
                killed = live.killed.is_set() or self._kill_marker(rec).exists()
                exit_code, guest_limit, vm_failed = self._vm_outcome(
                    vm, rc, bytes(console_cap.buf), bytes(qemu_err.buf),
                    "killed" if killed else ended_by, live.cg.oom_kills() > 0)
            we_killed = ended_by != "exit"  # the loop above SIGKILLed it (kill, ttl, pids)
            if live.killed.is_set() or self._kill_marker(rec).exists():
                ended_by = "killed"
                we_killed = True
            if we_killed:
                # util-linux unshare, seeing its child die of SIGKILL before its own SIGKILL
                # lands, cannot re-raise it (signal(SIGKILL) is EINVAL) and exits 1:
                # report what really happened
                exit_code = 128 + signal.SIGKILL
            elif ended_by == "exit" and (
                guest_limit or live.cg.oom_kills() > 0
                # a fork bomb whose shell died of a failed fork between two polls above
                or (vm is None and live.cg.pids_failures() >= limits_pids_fail)
                or (exit_code != 0 and self._scratch_full(rec))
            ):
                ended_by = "limit"  # OOM kill, pids limit, or a failure on a full scratch
            if spec.export_dir is not None:
                exported = self._export(rec, profile, spec.export_dir, policy_version)
        finally:
            t_run = time.monotonic()
            self._wait_nflog_drain()
            ours = self._teardown(rec.task_id)
            t_end = time.monotonic()
        duration = t_end - t0
        if end_due(ours):  # else a kill or reconcile elsewhere removed it, with its event
            self._emit(end_event(ours, ended_by, exit_code=exit_code, duration_s=duration,
                                 policy_version=policy_version,
                                 accounting=self._end_accounting(ours)))
        else:  # the remover's end event reports it; this writer's tally ends here
            self._logged.pop(rec.task_id, None)
            self.events.end_task(rec.task_id)
        if vm_failed is not None:  # torn down above, like any sandbox that fails to start
            # QEMU's and the console's words go to the orchestrator without host paths (the
            # raw line is in the launcher's log, see _vm_outcome)
            raise LauncherError(_scrub_vm_error(vm_failed, self._scrubber(rec, spec),
                                                self.s.microvm.image_dir))
        scrubber = self._scrubber(rec, spec)
        stdout = scrub.scrub(bytes(out_cap.buf).decode("utf-8", "replace") if out_cap else "",
                             scrubber)
        stderr = scrub.scrub(bytes(err_cap.buf).decode("utf-8", "replace") if err_cap else "",
                             scrubber)
        return RunResult(
            task_id=rec.task_id, exit_code=exit_code, stdout=stdout, stderr=stderr,
            duration_s=round(duration, 6), denials=self.denials(rec.task_id),
            exports=exported, ended_by=ended_by,
            timings={"setup_s": t_setup - t0, "run_s": t_run - t_setup,
                     "teardown_s": t_end - t_run},
            **_capture_fields(out_cap, err_cap),
        )

    def list(self) -> list[dict[str, Any]]:
        return [
            {"task_id": r.task_id, "profile": r.profile, "address": r.guest_ip,
             "state": r.state, "isolation": r.isolation, "started_at": r.started_at,
             "expires_at": r.expires_at, "owner_pid": r.owner_pid}
            for r in self.state.read().values()
        ]

    def _operator_event(self, rec: SandboxRecord | None, task_id: str, what: str) -> None:
        self._emit(make_event(
            component="launcher", action="sandbox_lifecycle", task_id=task_id,
            profile=rec.profile if rec else None, source_ip=rec.guest_ip if rec else None,
            message=f"sandbox {what} requested", extra={"lifecycle": what},
        ))

    def kill(self, task_id: str) -> bool:
        """Kill and remove a sandbox (from any launcher process); False when unknown."""
        rec = self.state.read().get(task_id)
        live = self._live.get(task_id)
        if rec is None and live is None:
            return False
        self._operator_event(rec or (live.record if live else None), task_id, "kill")
        if live is not None:
            live.killed.set()
            live.cg.kill_all()
            if live.proc is not None:
                self._kill_proc(live.proc)
            return True
        assert rec is not None
        with contextlib.suppress(OSError):
            self._kill_marker(rec).touch()
        cgroups.CgroupSet(self.s.cgroup_root, self.s.cgroup_parent, task_id).kill_all()
        if rec.owner_alive() and rec.owner_pid != os.getpid():
            # the owner notices its command died and tears down; wait for that
            for _ in range(200):
                if task_id not in self.state.read():
                    return True
                time.sleep(0.01)
        gone = self._teardown(task_id)
        if end_due(gone):  # the owner is gone (or slow): this kill writes the end event
            self._emit(end_event(gone, "killed", accounting=self._end_accounting(gone)))
        return True

    def suspend(self, task_id: str) -> bool:
        return self._freeze(task_id, True)

    def resume(self, task_id: str) -> bool:
        return self._freeze(task_id, False)

    def reconcile(self) -> dict[str, list[str]]:
        """Remove everything of this launcher's naming that no live launcher owns."""
        removed: dict[str, list[str]] = {"sandboxes": [], "netns": [], "links": [],
                                         "elements": [], "cgroups": [], "scratch": []}
        self._retry_deregistrations()
        for tid, rec in self.state.read().items():
            try:
                if rec.state == DEREGISTERING:  # torn down; its deregistration is retried
                    continue
                if tid in self._live or (rec.owner_alive() and rec.owner_pid != os.getpid()):
                    continue
                self._reconcile_orphan(tid)
            except Exception as e:  # one bad record must not keep every other orphan
                logging.getLogger("stockade.launcher").error(
                    "reconcile: sandbox %s: %s: %s", tid, type(e).__name__, e)
                continue
            removed["sandboxes"].append(tid)
        # under the state lock: a sandbox another launcher is creating has its record
        # written before any of its pieces exist, so nothing of a live sandbox is removed
        with self.state.locked() as records:
            self._reconcile_names(set(records), removed)
            self._end_tasks_gone_elsewhere(records)
        return removed

    def _end_tasks_gone_elsewhere(self, records: dict[str, SandboxRecord]) -> None:
        """This reader's pending summaries and `event_totals` of sandboxes another process
        removed (and wrote the end event of): written once their record is gone (or only
        a pending deregistration), not left in memory until this writer closes."""
        present = {t for t, r in records.items() if r.state != DEREGISTERING}
        for tid in [t for t in list(self._logged)
                    if t not in present and t not in self._ending and t not in self._live]:
            self._logged.pop(tid, None)
            self.events.end_task(tid)

    def _retry_deregistrations(self) -> None:
        retry_pending(self.state, self._deregister)

    def _deregister(self, task_id: str, sockets: list[str]) -> list[str]:
        failed = deregister(task_id, sockets) if self.register_tasks else []
        self.deregister_failures += len(failed)
        return failed

    def _reconcile_orphan(self, task_id: str) -> None:
        gone = self._teardown(task_id)
        if end_due(gone):  # its run is gone: nobody else will say it ended
            self._emit(end_event(gone, "orphaned", accounting=self._end_accounting(gone)))

    def _reconcile_names(self, keep: set[str], removed: dict[str, list[str]]) -> None:
        keep_if = {self._ifname(t) for t in keep}
        p = self.s.name_prefix
        for ns in netns.list_netns(p):
            if ns[len(p) + 1:] not in keep and TASK_ID_RE.match(ns[len(p) + 1:]):
                netns.destroy(ns, self._ifname(ns[len(p) + 1:]))
                removed["netns"].append(ns)
        for link in netns.list_links(p):
            if link not in keep_if and TASK_ID_RE.match(link[len(p):]):
                netns.destroy(self._netns(link[len(p):]), link)
                removed["links"].append(link)
        stale = []
        listed = nft.list_elements(self.s.nft_table)
        for elems in (listed.get(n, []) for n in nft.PER_SANDBOX_SETS):
            for e in elems:
                name = nft.element_ifname(e)
                if name and name not in keep_if and name.startswith(p):
                    stale.append(name)
        for name in sorted(set(stale)):
            self._delete_elements_by_name(name)
            removed["elements"].append(name)
        for name in cgroups.leftover_names(self.s.cgroup_root, self.s.cgroup_parent):
            if name not in keep and TASK_ID_RE.match(name):
                cg = cgroups.CgroupSet(self.s.cgroup_root, self.s.cgroup_parent, name)
                cg.kill_all()
                cg.remove()
                removed["cgroups"].append(name)
        if self.scratch_base.is_dir():
            for d in self.scratch_base.iterdir():
                if d.name not in keep and TASK_ID_RE.match(d.name):
                    self._remove_scratch(d)
                    removed["scratch"].append(d.name)

    def denials(self, task_id: str) -> list[dict[str, Any]]:
        """The task's denial events from every component, read from its per-task store
        (stockade/events/taskstore.py), which rotation of the shared file cannot erase."""
        return denials_of(read_task_events(self.config.task_events_dir, task_id))

    def _end_accounting(self, rec: SandboxRecord) -> dict[str, Any]:
        """Bypass counts and every component's event totals for the end event (`rec`: the
        record this caller's teardown removed); the launcher's own summaries and totals
        are written first. The logged count is this process's reader's tally when it
        holds the NFLOG group (it read every sandbox's records), else what the task's
        store holds (another launcher's reader, or a dead run's, wrote them), once that
        reader has written its summaries and totals of the sandbox."""
        own = rec.owner_pid == os.getpid() and rec.owner_alive()
        logged = self._logged.pop(rec.task_id, 0)
        if not self.nflog_bound:  # another process's reader (the service) wrote them
            # the reader ends the task's tally when it sees the record gone
            # (_end_tasks_gone_elsewhere): wait for it, so the end event counts it too
            stored = await_reader_totals(functools.partial(
                read_task_events, self.config.task_events_dir, rec.task_id))
            logged = max(logged, logged_in_store(stored))
        total = rec.bypass
        if self.nflog_bound or not own:  # else another launcher's reader reported them
            ev = unlogged_bypass_summary(
                rec.task_id, rec.profile, total, logged, rec.started_at, time.time())
            if ev is not None:
                self._emit(ev)
        self.events.end_task(rec.task_id)
        self._ending.discard(rec.task_id)
        stored = read_task_events(self.config.task_events_dir, rec.task_id)
        return end_accounting(stored, max(total, logged), logged)

    # -- creation ------------------------------------------------------------------------
    def _profile(self, name: str, ruleset: Any) -> Any:
        if ruleset is None:
            from stockade.policy import load_rules  # type: ignore[attr-defined]

            ruleset = load_rules(self.config.rules_dir)
        return profile_of(ruleset, name)

    def _ifname(self, task_id: str) -> str:
        return f"{self.s.name_prefix}{task_id}"

    def _netns(self, task_id: str) -> str:
        return f"{self.s.name_prefix}-{task_id}"

    def _kill_marker(self, rec: SandboxRecord) -> Path:
        return self.scratch_base / rec.task_id / "killed"

    def _create(
        self, spec: SandboxSpec, profile: Any, policy_version: str | None,
        isolation: dict[str, str], backend: Backend = "netns",
    ) -> _Live:
        if not spec.argv:
            raise LauncherError("empty command")
        for k in spec.env:
            if not ENV_NAME_RE.match(k) or k.startswith("STOCKADE_"):
                raise LauncherError(f"invalid environment name {k!r}")
        proxy_env = bool(getattr(profile, "proxy_env", False))
        if proxy_env:
            problem = proxy_listen_problem(self.config.gateway.proxy_listen)
            if problem is not None:
                raise LauncherError(f"profile {profile.name!r} sets egress.proxy_env: {problem}")
        inputs = self._check_inputs(spec.inputs)
        limits = profile.limits
        ttl = min(spec.ttl, limits.ttl) if spec.ttl else limits.ttl
        live = self._claim(profile.name, ttl, isolation["isolation"])
        rec, cg, task_id = live.record, live.cg, live.record.task_id
        a = slot_addresses(self.s.address_pool, rec.slot)
        now = rec.started_at
        vm = self.s.microvm
        try:
            if backend == "microvm":
                # the host cgroup holds QEMU; the profile's memory and pids apply in the guest
                cg.create(cgroups.Limits(
                    memory=microvm.host_memory_limit(limits.memory, limits.disk,
                                                     vm.guest_kernel_mib, vm.vmm_overhead_mib),
                    pids=vm.vmm_pids, cpus=limits.cpus))
            else:
                cg.create(cgroups.Limits(memory=limits.memory, pids=limits.pids,
                                         cpus=limits.cpus))
            base = self.scratch_base / task_id
            root, scratch, etc = base / "root", base / "scratch", base / "etc"
            for d in (root, scratch, etc):
                d.mkdir(parents=True, exist_ok=True)
            os.chmod(base, 0o711)  # noqa: S103 - traversable, not listable
            mounts.mount_tmpfs(str(scratch), limits.disk, self.s.sandbox_uid, self.s.sandbox_gid)
            for sub in ("out", "tmp", "home"):
                (scratch / sub).mkdir()
                os.chown(scratch / sub, self.s.sandbox_uid, self.s.sandbox_gid)
            os.chmod(scratch / "tmp", 0o1777)  # noqa: S103 - sticky /tmp inside
            host_etc = self._host_etc()
            etc_names = initscript.HOST_ETC_OVERLAY if host_etc else initscript.GENERATED_ETC
            content = initscript.etc_content(a.host_ip, "sandbox", self.s.sandbox_uid,
                                             self.s.sandbox_gid)
            for name in etc_names:
                (etc / name).write_text(content[name])
                os.chmod(etc / name, 0o644)  # root's, readable: the bind is read-only too
            # the gateway's inspection CA, so clients verify inspected TLS flows; with the
            # host's whole /etc bound there is no generated /etc to put it in (docs/launcher.md)
            trusted = None if host_etc else trust.write_trust_bundle(self.config, etc)
            trust_vars = {} if trusted is None else trusted[1]
            if trusted is not None:
                etc_names = (*etc_names, trusted[0])
            rec.ifindex = netns.create(rec.netns, rec.ifname, a,
                                        tap=microvm.TAP if backend == "microvm" else None)
            self._ifindex[rec.ifindex] = (task_id, profile.name)
            nft.run(nft.element_commands(self.s.nft_table, "add",
                                         [self._wiring(rec, proxy=proxy_env)]))
            if self.register_tasks:
                task = Task(task_id, a.guest_ip, profile.name, expires_at=now + ttl + 5)
                for path in self._control_sockets():
                    live.registered.append(path)
                    try:
                        ControlClient(path).register(task)
                    except (FileNotFoundError, ConnectionRefusedError):
                        live.registered.remove(path)  # it never reached a service
                        raise LauncherError(f"cannot register task with {path}: "
                                            "the service is not running") from None
                    except ControlError as e:  # the service's own words (507 state_write_...)
                        raise LauncherError(f"cannot register task with {path}: "
                                            f"{e.describe()}") from None
                    except Exception as e:  # fail closed: never run unregistered
                        raise LauncherError(f"cannot register task with {path}: "
                                            f"{type(e).__name__}") from None
            if backend == "microvm":
                self._start_vm(live, spec, profile, a, inputs, proxy_env, host_etc, trust_vars)
            else:
                self._start_netns(live, spec, a, inputs, proxy_env, host_etc, etc_names,
                                  trust_vars, self._seccomp(profile))
            with self.state.locked() as records:
                if task_id in records:
                    records[task_id].pid = live.proc.pid  # type: ignore[union-attr]
                    records[task_id].ifindex = rec.ifindex
                    records[task_id].state = "running"
        except BaseException as e:
            self._teardown(task_id)
            if isinstance(e, StateWriteError):
                raise LauncherError(f"cannot write the launcher state {e.path}: {e}") from None
            raise
        self._emit(make_event(
            component="launcher", action="sandbox_lifecycle", task_id=task_id,
            profile=profile.name, policy_version=policy_version, source_ip=a.guest_ip,
            message="sandbox started" if len(isolation) == 1 else (
                f"sandbox started at {PROVIDED_ISOLATION} grade "
                f"(the profile asks for {isolation['isolation_requested']})"),
            extra={"lifecycle": "start", "ttl_s": ttl, **isolation},
        ))
        return live

    def _claim(self, profile: str, ttl: float, isolation: str) -> _Live:
        """A task id, a slot and the sandbox's record (state `starting`), written before
        any piece of it exists; on any error nothing of it is left."""
        now = time.time()
        task_id = ""
        # an address whose old task is still registered is never handed out (its record
        # keeps the slot); a retry that succeeds now frees it
        self._retry_deregistrations()
        try:
            with self.state.locked() as records:
                while not task_id or task_id in records:
                    task_id = secrets.token_hex(5)
                slot = free_slot(self.s.address_pool, (r.slot for r in records.values()))
                a = slot_addresses(self.s.address_pool, slot)
                cg = cgroups.CgroupSet(
                    self.s.cgroup_root, self.s.cgroup_parent, task_id, self.s.cgroup_cpu_weight
                )
                rec = SandboxRecord(
                    task_id=task_id, profile=profile, slot=slot,
                    ifname=self._ifname(task_id), netns=self._netns(task_id),
                    host_ip=a.host_ip, guest_ip=a.guest_ip,
                    guest_mac=a.guest_mac, owner_pid=os.getpid(),
                    owner_start=start_time(os.getpid()) or 0,
                    scratch=str(self.scratch_base / task_id), cgroups=cg.paths,
                    started_at=now, expires_at=now + ttl, isolation=isolation,
                )
                # known as live before the record is visible: a concurrent kill() finds it
                live = _Live(rec, cg)
                self._live[task_id] = live
                records[task_id] = rec
                # another launcher's close() may have removed the table
                if not nft.table_exists(self.s.nft_table):
                    nft.apply_table(self.params)
        except BaseException as e:  # the record was not written: nothing exists yet
            self._live.pop(task_id, None)
            if isinstance(e, StateWriteError):  # a full state disk
                raise LauncherError(f"cannot write the launcher state {e.path}: {e}") from None
            raise
        return live

    def _start_netns(self, live: _Live, spec: SandboxSpec, a: Any,
                     inputs: list[initscript.Bind], proxy_env: bool, host_etc: bool,
                     etc_names: tuple[str, ...], trust_vars: dict[str, str],
                     bpf: bytes) -> None:
        """The command in its own mount/pid/ipc/uts namespaces, `sandbox_init.py` as pid 1,
        under the seccomp program `bpf`."""
        rec, cg = live.record, live.cg
        base = Path(rec.scratch)
        root, scratch, etc = base / "root", base / "scratch", base / "etc"
        plan = initscript.InitPlan(
            root=str(root), scratch=str(scratch), etc_dir=str(etc),
            uid=self.s.sandbox_uid, gid=self.s.sandbox_gid,
            system=tuple(self._system_binds()), inputs=tuple(inputs),
            etc_files=etc_names, host_etc=host_etc,
            etc=() if host_etc else tuple(self._etc_binds()),
            etc_over=((trust.TRUST_BUNDLE_NAME, trust.DEFAULT_BUNDLE),) if trust_vars else (),
            shm_size=self.s.shm_size, cgroup_procs=tuple(cg.procs_files()),
            rlimits=(("NOFILE", self.s.rlimit_nofile), ("CORE", self.s.rlimit_core),
                     ("MEMLOCK", self.s.rlimit_memlock)),
            congestion_control=self._congestion_control,
        )
        env = self._env(spec, a.host_ip, proxy=proxy_env, trust=trust_vars)
        # the plan travels in a memfd, not argv: /proc/1/cmdline shows no host paths
        plan_fd = os.memfd_create("stockade-init-plan", 0)
        try:
            os.write(plan_fd, marshal.dumps({**initscript.build(plan), "env": env,
                                             "seccomp": bpf}, 4))
            os.lseek(plan_fd, 0, os.SEEK_SET)
            argv = ["nsenter", f"--net={netns.NETNS_DIR}/{rec.netns}", "--",
                    "unshare", "--mount", "--pid", "--ipc", "--uts", "--fork",
                    "--kill-child", "--propagation", "private", "--",
                    self._init_python(), "-I", "-S", "-c", _init_source(), str(plan_fd),
                    *spec.argv]
            live.proc = subprocess.Popen(
                argv, env={"PATH": SANDBOX_PATH}, stdin=subprocess.PIPE if spec.stdin is not None
                else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True, pass_fds=(plan_fd,), start_new_session=True, cwd="/",
            )
        finally:
            os.close(plan_fd)


    def _start_vm(self, live: _Live, spec: SandboxSpec, profile: Any, a: Any,
                  inputs: list[initscript.Bind], proxy_env: bool, host_etc: bool,
                  trust_vars: dict[str, str]) -> None:
        """QEMU in the sandbox's netns and cgroups, its guest wired to the tap (see microvm.py).

        Raises LauncherError for anything that stops the VM from starting; the caller tears
        down what exists.
        """
        rec, cg, vm, limits = live.record, live.cg, self.s.microvm, profile.limits
        try:
            image = vmimage.load_image(vm.image_dir)
        except ValueError as e:
            raise LauncherError(str(e)) from None
        qemu = vmimage.qemu_path(vm.qemu)
        if qemu is None:
            raise LauncherError(f"QEMU ({vm.qemu}) is not installed")
        accel = vmimage.resolve_accel(
            vm.accel, vm.qemu, image,
            Path(self.config.state_dir) / "launcher" / "microvm-accel.json", vm.probe_timeout_s)
        base = Path(rec.scratch)
        cfg, etc, staged = base / "cfg", base / "etc", base / "inputs"
        cfg.mkdir(mode=0o755)
        os.chmod(cfg, 0o755)  # noqa: S103 - QEMU reads it after dropping to sandbox_uid
        if not host_etc:  # the guest's /etc is this directory: the allowlist copied in
            for b in self._etc_binds():
                _copy_into(b, etc / os.path.relpath(b.target, HOST_ETC))
            default = etc / trust.DEFAULT_BUNDLE
            if trust_vars and default.is_file() and not default.is_symlink():
                # the trust bundle over the system's default one, as the netns backend binds it
                tmp = default.with_name(f".{default.name}.stockade")
                shutil.copyfile(etc / trust.TRUST_BUNDLE_NAME, tmp)
                os.chmod(tmp, 0o644)
                os.replace(tmp, default)
        overlay = tuple(n for n in initscript.HOST_ETC_OVERLAY
                        if os.path.exists(os.path.join(HOST_ETC, n)))
        try:
            layout, copies = microvm.guest_layout(
                system=self._system_binds(), etc_dir=str(etc), host_etc=host_etc,
                host_etc_overlay=overlay, scratch=str(base / "scratch"), inputs=inputs,
                staged_dir=str(staged), shm_size=self.s.shm_size)
            mount_table = microvm.mount_table(layout)
            input_table = microvm.input_table(layout)
        except ValueError as e:
            raise LauncherError(f"cannot start the microVM: {e}") from None
        if copies:  # file inputs: copied into one staged share (9p shares directories)
            staged.mkdir(mode=0o755)
            for src, dest in copies:
                shutil.copyfile(src, dest)
                os.chmod(dest, 0o644)
        env = self._env(spec, a.host_ip, proxy=proxy_env, trust=trust_vars)
        if spec.stdin is not None:
            (cfg / "stdin").write_bytes(spec.stdin)
        setpriv = self._guest_setpriv()
        plan = microvm.guest_plan(
            argv=list(spec.argv), env=env, uid=self.s.sandbox_uid, gid=self.s.sandbox_gid,
            rlimits={"NOFILE": self.s.rlimit_nofile, "CORE": self.s.rlimit_core,
                     "MEMLOCK": self.s.rlimit_memlock},
            guest_ip=a.guest_ip, host_ip=a.host_ip, prefixlen=a.prefixlen,
            memory=limits.memory, pids=limits.pids, pids_fail_kill=self.s.pids_fail_kill,
            stdin=spec.stdin is not None, setpriv=setpriv,
            congestion_control=self._congestion_control, seccomp=self._seccomp(profile),
            reserved=(*initscript.RESERVED, *self.s.ro_binds))
        (cfg / "plan").write_bytes(microvm.encode_plan(plan))
        (cfg / "mounts").write_text(mount_table)
        (cfg / "inputs").write_text(input_table)
        (cfg / "python").write_text(self.s.init_python + "\n")
        (cfg / "guest_init.py").write_text(_guest_init_source())
        for f in cfg.iterdir():
            os.chmod(f, 0o644)
        # pipes: QEMU writes the console and the three ports; the launcher reads
        pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(4)]
        try:
            spec_vm = microvm.VmSpec(
                qemu=qemu, accel=accel, kernel=image.kernel, initrd=image.initrd,
                memory_mib=microvm.guest_memory_mib(limits.memory, vm.guest_kernel_mib),
                cpus=microvm.vcpus(limits.cpus), mac=a.guest_mac, cfg_dir=str(cfg),
                layout=layout, console=f"/proc/self/fd/{pipes[0][1]}",
                ports=(f"/proc/self/fd/{pipes[1][1]}", f"/proc/self/fd/{pipes[2][1]}",
                       f"/proc/self/fd/{pipes[3][1]}"),
                tsc_khz=vmimage.tsc_khz(), tb_size_mib=vm.tb_size_mib,
                runas=(self.s.sandbox_uid, self.s.sandbox_gid) if vm.harden_qemu else None,
                seccomp=vm.harden_qemu)
            try:
                qargv = microvm.qemu_argv(spec_vm)
            except ValueError as e:
                raise LauncherError(f"cannot start the microVM: {e}") from None
            # QEMU joins the sandbox's cgroups before it allocates anything (a shell that
            # moves itself, then execs), then enters the netns, and runs as pid 1 of a pid
            # namespace of its own with its own /proc (it sees no host process; its end
            # ends the namespace) in a private mount namespace; the paths are arguments.
            # No chroot: QEMU 7.2's 9p server still resolves some operations (file
            # creation) by path, and the scratch share fails under -chroot
            argv = ["sh", "-c", _JOIN_CGROUPS, "sh", *cg.procs_files(), "--",
                    "nsenter", f"--net={netns.NETNS_DIR}/{rec.netns}", "--",
                    "unshare", "--pid", "--fork", "--kill-child", "--mount",
                    "--propagation", "private", "--mount-proc", "--", *qargv]
            live.proc = subprocess.Popen(
                argv, env={"PATH": SANDBOX_PATH}, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True,
                pass_fds=tuple(w for _, w in pipes), start_new_session=True, cwd="/")
            live.vm = _VmPipes(*(os.fdopen(r, "rb") for r, _ in
                                 [pipes[1], pipes[2], pipes[3], pipes[0]]))
        except BaseException:
            for r, _ in pipes:
                with contextlib.suppress(OSError):
                    os.close(r)
            raise
        finally:
            for _, w in pipes:
                os.close(w)

    def _vm_outcome(self, vm: _VmPipes, qemu_rc: int, console: bytes, qemu_err: bytes,
                    ended_by: str, host_oom: bool) -> tuple[int, bool, str | None]:
        """(exit code, the guest hit a limit, why the VM failed or None) once QEMU is gone."""
        try:
            status = microvm.parse_status(vm.status.read(256).decode("ascii", "replace"))
        except OSError:
            status = None
        if status is not None:
            rc, ooms, pids = status
            return rc, ooms > 0 or pids >= self.s.pids_fail_kill, None
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

    def _guest_setpriv(self) -> str:
        """util-linux setpriv on a path the guest sees (the host's, through ro_binds)."""
        path = shutil.which("setpriv", path="/usr/bin:/bin")
        if path is None or not any(path.startswith(os.path.normpath(p) + "/")
                                   for p in self.s.ro_binds):
            raise LauncherError("the microVM guest needs util-linux setpriv under ro_binds")
        return path

    def _seccomp(self, profile: Any) -> bytes:
        """The profile's seccomp program; without one no sandbox starts (fail closed)."""
        try:
            return seccomp_bpf.filter_for(self._init_python(), profile)
        except seccomp_bpf.SeccompError as e:
            raise LauncherError(str(e)) from None

    def _init_python(self) -> str:
        # the sandbox can read its pid 1's argv: prefer the system interpreter's plain path
        p = self.s.init_python
        return p if p and os.access(p, os.X_OK) else sys.executable

    def _check_inputs(self, inputs: list[tuple[str, str]]) -> list[initscript.Bind]:
        out = []
        for host, guest in inputs:
            hp = os.path.realpath(host)
            if not os.path.exists(hp):
                raise LauncherError(f"input does not exist: {host}")
            try:
                initscript.check_input_target(guest, extra=self.s.ro_binds)
            except ValueError as e:
                raise LauncherError(str(e)) from None
            out.append(initscript.Bind(hp, guest, is_dir=os.path.isdir(hp)))
        return out

    def _system_binds(self) -> list[initscript.Bind]:
        return [b for p in self.s.ro_binds if (b := _host_bind(p, p)) is not None]

    def _host_etc(self) -> bool:
        """`ro_binds` lists /etc itself: the host's whole /etc, as before the minimal one."""
        return any(os.path.normpath(p) == HOST_ETC for p in self.s.ro_binds)

    def _etc_binds(self) -> list[initscript.Bind]:
        """The host /etc entries `etc_allowlist` names (globs expanded; absent ones skipped)."""
        out: dict[str, initscript.Bind] = {}
        for entry in self.s.etc_allowlist:
            for p in sorted(glob.glob(os.path.join(HOST_ETC, entry))):
                b = _host_bind(p, p)
                if b is not None:
                    out.setdefault(p, b)
        return list(out.values())

    def _env(self, spec: SandboxSpec, host_ip: str, proxy: bool = False,
             trust: dict[str, str] | None = None) -> dict[str, str]:
        """The command's environment. `proxy` (the profile's `egress.proxy_env`): point
        HTTP(S)_PROXY at the gateway's explicit proxy on the host-side veth address (the
        nft exemption of `SET_PROXY` lets exactly that through); the broker stays direct."""
        env = {k: os.environ[k] for k in self.s.env_allowlist if k in os.environ}
        env.update(trust or {})  # before spec.env: a task's own CA for a private mirror wins
        env.update(spec.env)
        env.update({
            "PATH": SANDBOX_PATH,
            "HOME": f"{initscript.SCRATCH}/home",
            "TMPDIR": "/tmp",  # noqa: S108 - the sandbox's own /tmp (in scratch)
            "STOCKADE_BROKER": f"http://{host_ip}:{self.params.broker_port}",
        })
        for k in PROXY_ENV_NAMES:
            env.pop(k, None)
        if proxy:
            if self.params.proxy_port is None:
                raise LauncherError("egress.proxy_env needs gateway.proxy_listen")
            url = f"http://{host_ip}:{self.params.proxy_port}"
            env.update({"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url,
                        "https_proxy": url, "NO_PROXY": host_ip, "no_proxy": host_ip})
        return env

    def _control_sockets(self) -> list[str]:
        return [self.config.gateway.control_socket, self.config.broker.control_socket]

    def _wiring(self, rec: SandboxRecord, proxy: bool = False) -> nft.Wiring:
        # `proxy` matters only for adding; deleting always removes the SET_PROXY element
        return nft.Wiring(rec.ifname, rec.guest_ip, rec.guest_mac, rec.host_ip, proxy=proxy)

    # -- teardown ------------------------------------------------------------------------
    @staticmethod
    def _kill_proc(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def _teardown(self, task_id: str) -> SandboxRecord | None:
        """Idempotent: each step tolerates its piece being gone already. Returns the
        record if this call removed it from the state file (then its end event is this
        caller's to write: launcher/ending.py), else None."""
        rec = self.state.read().get(task_id)
        live = self._live.get(task_id)
        if rec is None and live is not None:
            rec = live.record
        cg = live.cg if live else cgroups.CgroupSet(self.s.cgroup_root, self.s.cgroup_parent,
                                                    task_id)
        cg.kill_all()
        if live is not None and live.proc is not None:
            self._kill_proc(live.proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                live.proc.wait(timeout=5)
        if live is not None and live.vm is not None:
            live.vm.close()
        failed: list[str] = []
        if rec is not None:
            failed = self._deregister(task_id, rec.deregister if rec.state == DEREGISTERING
                                      else live.registered if live is not None
                                      else self._control_sockets())
            rec.bypass = self._keep_bypass_count(rec)
            with contextlib.suppress(nft.NftError):
                nft.run(nft.element_commands(self.s.nft_table, "delete", [self._wiring(rec)]))
            netns.destroy(rec.netns, rec.ifname)
            self._ifindex.pop(rec.ifindex, None)
        else:
            netns.destroy(self._netns(task_id), self._ifname(task_id))
        cg.remove()
        self._remove_scratch(self.scratch_base / task_id)
        removed: SandboxRecord | None = None
        try:
            with self.state.locked() as records:
                removed = settle(records, task_id, failed, rec.bypass if rec else 0)
                if end_due(removed):  # marked before the removal is written
                    self._ending.add(task_id)
        except StateWriteError as e:
            # every piece is gone; the record (owner pid gone with this process) goes at
            # the next reconcile that can write, which then writes the end event
            removed = None
            logging.getLogger("stockade.launcher").error(
                "sandbox %s torn down, but its record stays: %s", task_id, e)
        self._live.pop(task_id, None)
        return removed

    def _keep_bypass_count(self, rec: SandboxRecord) -> int:
        """Copies the sandbox's nft bypass counter into its state record before the
        counter's element goes: a racing teardown that reads it after then still finds
        the count in the record it may be the one to remove."""
        count = rec.bypass
        with contextlib.suppress(OSError, ValueError):
            count = max(count, nft.bypass_count(self.s.nft_table, rec.ifname))
        with contextlib.suppress(StateWriteError), self.state.locked() as records:
            if rec.task_id in records:
                stored = records[rec.task_id]
                stored.bypass = count = max(stored.bypass, count)
        return count

    def _delete_elements_by_name(self, ifname: str) -> None:
        """Remove every element of an interface whose record is lost (reconcile)."""
        listed = nft.list_elements(self.s.nft_table)
        for set_name in nft.PER_SANDBOX_SETS:
            for e in listed.get(set_name, []):
                if nft.element_ifname(e) == ifname:
                    payload = {"nftables": [{"delete": {"element": {
                        "family": "inet", "table": self.s.nft_table, "name": set_name,
                        "elem": [e]}}}]}
                    with contextlib.suppress(nft.NftError):
                        nft.run(payload)

    def _remove_scratch(self, base: Path) -> None:
        scratch = base / "scratch"
        for _ in range(3):
            if not mounts.umount(str(scratch)):
                break
        shutil.rmtree(base, ignore_errors=True)

    def _scratch_full(self, rec: SandboxRecord) -> bool:
        try:
            st = os.statvfs(Path(rec.scratch) / "scratch")
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < 64 * 1024

    def _freeze(self, task_id: str, frozen: bool) -> bool:
        rec = self.state.read().get(task_id)
        if rec is None:
            return False
        self._operator_event(rec, task_id, "suspend" if frozen else "resume")
        cgroups.CgroupSet(self.s.cgroup_root, self.s.cgroup_parent, task_id).freeze(frozen)
        with self.state.locked() as records:
            if task_id in records:
                records[task_id].state = "frozen" if frozen else "running"
        return True

    # -- exports -------------------------------------------------------------------------
    def _export(self, rec: SandboxRecord, profile: Any, dest: str,
                policy_version: str | None) -> list[ExportedFile]:
        pol = profile.exports
        out_dir = str(Path(rec.scratch) / "scratch" / "out")
        cands, contents = exports.scan(out_dir, pol.max_file_bytes)
        result = []
        for d in exports.decide(cands, pol.max_file_bytes, pol.max_total_bytes, pol.types):
            info = {"name": d.name, "size": d.size, "type": d.kind or "unknown"}
            if d.allowed:
                try:
                    exports.write_export(dest, d.name, contents[d.name])
                except (OSError, ValueError):
                    d = exports.ExportDecision(d.name, d.size, d.kind, False, "write_failed")
            if d.allowed:
                result.append(ExportedFile(d.name, d.size, d.kind or "unknown"))
                self._emit(make_event(
                    component="launcher", action="export_decision", decision="allowed",
                    reason="allowed_by_rule", task_id=rec.task_id, profile=rec.profile,
                    policy_version=policy_version, message=f"exported {d.name}",
                    extra={"export": info}))
            else:
                self._emit(make_event(
                    component="launcher", action="export_decision", decision="denied",
                    reason="export_refused", task_id=rec.task_id, profile=rec.profile,
                    policy_version=policy_version,
                    message=f"export of {d.name} refused: {d.why}",
                    extra={"export": {**info, "why": d.why}}))
        return result

    # -- scrubbing -------------------------------------------------------------------------
    def _scrubber(self, rec: SandboxRecord, spec: SandboxSpec) -> scrub.Scrubber:
        paths = [str(self.scratch_base), self.config.state_dir, self.config.log_dir,
                 self.config.run_dir, os.getcwd(), os.path.expanduser("~")]
        paths += [os.path.realpath(h) for h, _ in spec.inputs]
        addrs = [rec.host_ip]
        for lst in (self.config.gateway.transparent_listen, self.config.dns.listen,
                    [self.config.broker.listen], self.config.gateway.resolvers):
            for item in lst:
                addrs.append(item.rsplit(":", 1)[0] if item.count(":") == 1 else item)
        if self.config.vault.address:
            addrs.append(self.config.vault.address)
        host_env = {k: v for k, v in os.environ.items() if k not in spec.env}
        return scrub.build(host_paths=paths, host_env=host_env,
                           hostnames=[socket.gethostname(), socket.getfqdn()], addresses=addrs)

    # -- events and NFLOG --------------------------------------------------------------------
    def _emit(self, event: dict[str, Any]) -> None:
        self.events.write(event)

    def _task_for_ifindex(self, ifindex: int | None) -> tuple[str, str] | None:
        if ifindex is None:
            return None
        hit = self._ifindex.get(ifindex)
        if hit is not None:
            return hit
        for r in self.state.read().values():  # a sandbox of another launcher process
            if r.ifindex == ifindex and r.state != DEREGISTERING:
                return r.task_id, r.profile
        return None

    def _nflog_loop(self) -> None:
        sock: NflogSocket | None = None
        while not self._stop.is_set():
            if sock is None:
                try:
                    sock = NflogSocket(self.s.nflog_group)
                    self.nflog_bound = True
                except OSError:
                    # another launcher holds the group and reports for every sandbox
                    self._stop.wait(1.0)
                    continue
            try:
                ready, _, _ = select.select([sock, self._wake_r], [], [], 0.5)
                # records first, then the drain request: all queued before it are handled
                for r in sock.recv_ready():
                    self.handle_log_record(r)
                if self._logged and time.monotonic() - self._foreign_check >= 0.25:
                    self._foreign_check = time.monotonic()
                    self._end_tasks_gone_elsewhere(self.state.read())
            except Exception:  # the reader must survive anything: reopen and go on
                sock.close()
                sock = None
                self.nflog_bound = False
                continue
            except OSError:
                sock.close()
                sock = None
                self.nflog_bound = False
                continue
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                with self._nflog_cv:
                    self._nflog_ticks += 1
                    self._nflog_cv.notify_all()
        if sock is not None:
            sock.close()

    def _wait_nflog_drain(self) -> None:
        """Let records the kernel already queued reach the events file before reading it."""
        if self._nflog_thread is None or not self.nflog_bound:
            return
        with self._nflog_cv:
            target = self._nflog_ticks + 1
            os.write(self._wake_w, b"x")
            self._nflog_cv.wait_for(lambda: self._nflog_ticks >= target, timeout=0.5)

    def handle_log_record(self, r: LogRecord) -> dict[str, Any] | None:
        owner = self._task_for_ifindex(r.ifindex)
        if owner is None:
            return None
        task_id, profile = owner
        # any launcher's sandbox: whoever removes it here reports the tally
        self._logged[task_id] = self._logged.get(task_id, 0) + 1
        what = r.prefix.split(":", 1)[-1] or "blocked"
        ev = make_event(
            component="launcher", action="bypass_attempt", decision="denied",
            reason="bypass_attempt", task_id=task_id, profile=profile,
            rule_id=f"launcher:{what}", source_ip=r.src, source_port=r.sport,
            destination_ip=r.dst, destination_port=r.dport, transport=r.transport,
            message=f"sandbox traffic outside the gateway and broker blocked ({what})",
            extra={"firewall": what},
        )
        self._emit(ev)
        return ev


def _capture_fields(out: _Capture | None, err: _Capture | None) -> dict[str, Any]:
    """RunResult's truncation fields of the two streams' captures."""
    return {"stdout_truncated": bool(out and out.truncated),
            "stderr_truncated": bool(err and err.truncated),
            "stdout_bytes": out.total if out else 0, "stderr_bytes": err.total if err else 0}


def _feed(stream: IO[bytes], data: bytes) -> None:
    with contextlib.suppress(OSError):
        stream.write(data)
    with contextlib.suppress(OSError):
        stream.close()


@functools.cache
def _guest_init_source() -> str:
    return (Path(__file__).with_name("guest_init.py")).read_text()


# moves this shell into each cgroup.procs file given before "--", then execs the rest
_JOIN_CGROUPS = ('for f; do shift; [ "$f" = -- ] && break; echo 0 > "$f" || exit 125; done; '
                 'exec "$@"')


def _copy_into(b: initscript.Bind, dest: Path) -> None:
    """Copy one allowlisted host /etc entry into the guest's /etc directory (symlinks as
    symlinks: the guest resolves them against its own /usr, like the netns sandbox)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if b.symlink_to is not None:
        os.symlink(b.symlink_to, dest)
    elif b.is_dir:
        shutil.copytree(b.source, dest, symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(b.source, dest)
        os.chmod(dest, 0o644)


@functools.cache
def _init_source() -> str:
    return (Path(__file__).with_name("sandbox_init.py")).read_text()


_ABS_PATH = re.compile(r"(?<![\w.])/[^\s,:;'\"()\[\]]+")


def _scrub_vm_error(text: str, scrubber: scrub.Scrubber, image_dir: str) -> str:
    """A failed microVM's reason (QEMU's last error line or the console's) for the caller:
    every absolute path (QEMU names its shares, kernel, fd paths) becomes <host-path>, then
    the sandbox's scrubbing (addresses, environment values, the host name; the image's
    directory too, in case a path hides in some other shape)."""
    text = _ABS_PATH.sub("<host-path>", text)
    extra = scrub.build(host_paths=[os.path.realpath(image_dir), image_dir])
    return scrub.scrub(scrub.scrub(text, scrubber), extra)


Hook = Callable[[str], None]
