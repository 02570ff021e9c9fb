"""The launcher: ephemeral sandboxes wired to the gateway and the broker, and nothing else.

`Launcher` is the Python API (the CLI and `stockade.stack` are thin callers). One sandbox =
a claimed record (claim.py) + netns + veth + nft set elements + cgroups + scratch
(rootfs.py) + registrations with gateway and broker, then the command under its backend
(backends/). Teardown (cleanup.py) tolerates pieces already gone: kill, crash recovery
and a normal end share it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stockade.events import EventWriter
from stockade.events.taskstore import sweep
from stockade.tasks import StateWriteError, Task

from . import exports, mounts, netns, nft, rootfs, scrub
from .addresses import SlotAddresses, slot_addresses
from .backends import (
    NAMES,
    Backend,
    Live,
    StartContext,
    backend_for,
    launch,
    pooled,
    seccomp_program,
)
from .claim import Claims
from .cleanup import Cleaner, wiring
from .denials import BypassCollector
from .deregistration import deregister, retry_pending
from .ending import end_due, end_event
from .environment import exec_env, permitted_congestion_control, port, sandbox_env
from .fence import Fence
from .isolation import PROVIDED_ISOLATION, choose_backend, preflight, profile_of
from .lifecycle import start_event
from .nflog import LogRecord
from .operator import freeze, kill_elsewhere, operator_event
from .poolplan import Shape, shape_of
from .registration import register as register_task
from .spec import (
    EndedBy,
    ExportedFile,
    LauncherError,
    RunResult,
    SandboxSpec,
    check_inputs,
    check_spec,
)
from .state import SandboxRecord, StateFile, state_path
from .supervise import capture_fields, classify_end, kill_marker
from .taskrecord import Recorder, backend_details, limits_of

if TYPE_CHECKING:  # annotations only
    from .configview import LauncherConfig as Config
    from .execspec import ExecProc, ExecSpec
    from .pools import PoolManager

# stockade/stack/run.py imports these from here
__all__ = ["ExportedFile", "Launcher", "LauncherError", "RunResult", "SandboxSpec", "preflight"]


class Launcher:
    def __init__(self, config: Config, *, events: EventWriter | None = None,
                 register: bool = True, nflog: bool = True, pools: bool = False) -> None:
        """`pools`: keep `launcher.pools` (the launcher service does; a one-shot run not)."""
        self.config = config
        self.s = s = config.launcher
        self.events = events or config.event_writer(stdout=False)
        self.register_tasks = register
        self.use_nflog = nflog
        self.state = StateFile(state_path(config.state_dir, s.nft_table))
        self.scratch_base = Path(s.scratch_dir)
        gw = config.gateway
        self.params = nft.TableParams(
            table=s.nft_table, transparent_port=port(gw.transparent_listen[0]),
            dns_port=port(config.dns.listen[0]), broker_port=port(config.broker.listen),
            nflog_group=s.nflog_group, log_rate=s.log_rate_per_s,
            proxy_port=port(gw.proxy_listen[0]) if gw.proxy_listen else None)
        self._started = False
        self._start_lock = threading.Lock()
        self._live: dict[str, Live] = {}
        self.bypass = BypassCollector(self.state, self.events, s.nflog_group,
                                      config.task_events_dir, self._live)
        self.cleaner = Cleaner(s, self.state, self.scratch_base, self._live, self.bypass,
                               self._deregister, self._control_sockets())
        self.claims = Claims(s, self.state, self.scratch_base, self._live, self.params,
                             self._retry_deregistrations)
        self.deregister_failures = 0  # failed deregistrations (each logged), retries too
        self._congestion_control = permitted_congestion_control(s.congestion_control)
        # task id -> the labels its spec asked for: in its registration and, through the
        # writer, in every event the launcher writes of it
        self._labels: dict[str, dict[str, str]] = {}
        self.events.label_with(self._labels.get)
        self.fence = Fence(config, self.params.broker_port, self._emit, self.claims.wired,
                           lambda: self.use_nflog and self.bypass.bound)
        self.recorder = Recorder(config, self._emit)
        self.pools: PoolManager | None = None
        if pools and s.pools.targets:
            from .pools import PoolManager  # here: its metrics' library is not small

            self.pools = PoolManager(s.pools, self._warm, self._teardown)

    # the NFLOG reader's state as before the split (the service's status reads the first)
    @property
    def nflog_bound(self) -> bool:
        return self.bypass.bound

    @property
    def _logged(self) -> dict[str, int]:
        return self.bypass.logged

    def start(self) -> None:
        """Install the nft table, reconcile leftovers of crashed runs, start the NFLOG reader."""
        with self._start_lock:
            if self._started:
                return
            mounts.private_dir(self.scratch_base)
            # under the state lock, as a claim's re-install: launchers starting at once
            # (concurrent `stockade run`s) must not interleave their table transactions
            with self.state.locked():
                nft.apply_table(self.params)
            self.reconcile()
            sweep(self.config.task_events_dir, self.config.events.task_retention_s)
            if self.use_nflog:
                self.bypass.start()
            if self.pools is not None:
                self.pools.start([n for n in NAMES if pooled(backend_for(n))])
            self._started = True

    def close(self) -> None:
        if self.pools is not None:
            self.pools.close()
        self.bypass.stop()
        for tid in list(self._live):
            self.kill(tid)
        if self._started:
            self.cleaner.remove_table_if_last()

    def __enter__(self) -> Launcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, spec: SandboxSpec, ruleset: Any = None) -> RunResult:
        """Run one command in a fresh sandbox and tear it down; never leaves pieces behind."""
        profile = self._profile(spec.profile, ruleset)
        name, isolation = choose_backend(self.s, profile)  # refused before anything is set up
        self.start()
        policy_version = getattr(ruleset, "version", None)
        t0 = time.monotonic()
        live = self._claim_warm(name, spec, profile, policy_version, isolation)
        if live is None:  # no pool of its shape, or it was empty
            live = self._create(spec, profile, policy_version, isolation, backend_for(name))
        rec = live.record
        t_setup = time.monotonic()
        ttl = rec.expires_at - time.time() if rec.expires_at else float(self.s.default_ttl_s)
        exported: list[ExportedFile] = []
        try:
            ended = live.backend.wait(live, spec, time.monotonic() + max(ttl, 0.0), self.s)
            ended_by, exit_code = classify_end(
                ended.ended_by, ended.exit_code,
                live.killed.is_set() or kill_marker(rec.scratch).exists(),
                lambda: (ended.limit_hit or live.cg.oom_kills() > 0
                         or (ended.exit_code != 0 and rootfs.scratch_full(rec.scratch))))
            if ended_by == "killed":  # a session's expiry kills it as `ttl`
                ended_by = live.ended_as
            if spec.export_dir is not None:
                exported = exports.export_files(
                    rec.task_id, rec.profile, profile.exports, rec.scratch, spec.export_dir,
                    policy_version, self._emit)
        finally:
            t_run = time.monotonic()
            self.bypass.wait_drain()
            ours = self._teardown(rec.task_id)
            t_end = time.monotonic()
        duration = t_end - t0
        record = None
        if end_due(ours):  # else a kill or reconcile elsewhere removed it, with its event
            self._emit(end_event(ours, ended_by, exit_code=exit_code, duration_s=duration,
                                 policy_version=policy_version,
                                 accounting=self.bypass.end_accounting(ours)))
            record = self._record(ours, spec, profile, isolation, policy_version, ended_by,
                                  exit_code)
        else:
            self.bypass.forget(rec.task_id)
        self._labels.pop(rec.task_id, None)
        scrubber = scrub.for_sandbox(self.config, str(self.scratch_base), rec.host_ip,
                                     spec.inputs, spec.env)
        if ended.failed is not None:  # torn down above, like any sandbox that fails to start
            from .backends.microvm import scrub_vm_error
            # QEMU's and the console's words go to the orchestrator without host paths (the
            # raw line is in the launcher's log, see backends/microvm.py:vm_outcome)
            raise LauncherError(scrub_vm_error(ended.failed, scrubber, self.s.microvm.image_dir))
        return RunResult(
            task_id=rec.task_id, exit_code=exit_code,
            stdout=scrub.scrub(ended.out.text(), scrubber),
            stderr=scrub.scrub(ended.err.text(), scrubber),
            duration_s=round(duration, 6), denials=self.denials(rec.task_id),
            exports=exported, ended_by=ended_by, record=record,
            timings={"setup_s": t_setup - t0, "run_s": t_run - t_setup,
                     "teardown_s": t_end - t_run},
            **capture_fields(ended.out, ended.err),
        )

    def exec(self, task_id: str, req: ExecSpec) -> ExecProc:
        """One more command in the running session sandbox `task_id` (`SandboxSpec.session`,
        run by this launcher); `req.env` holds only the caller's additions, merged under
        the sandbox's own rules. LauncherError when there is no such sandbox."""
        live = self._live.get(task_id)
        if live is None or live.ctx is None or live.killed.is_set():
            raise LauncherError(f"no running session sandbox {task_id} in this launcher")
        full = dataclasses.replace(req, env=exec_env(live.ctx.env, req.env))
        return live.backend.exec(live, full, live.ctx)

    def scrubber(self, task_id: str, spec: SandboxSpec) -> scrub.Scrubber:
        """The output scrubber of a running sandbox (as its end result is scrubbed)."""
        live = self._live.get(task_id)
        if live is None:
            raise LauncherError(f"no running sandbox {task_id} in this launcher")
        return scrub.for_sandbox(self.config, str(self.scratch_base), live.record.host_ip,
                                 spec.inputs, spec.env)

    def scratch_root(self, task_id: str) -> str | None:
        """The host path of a running sandbox's /scratch (None: not one of ours)."""
        live = self._live.get(task_id)
        return None if live is None else str(Path(live.record.scratch) / "scratch")

    def _record(self, rec: SandboxRecord, spec: SandboxSpec, profile: Any,
                isolation: dict[str, Any], policy_version: str | None, ended_by: str,
                exit_code: int | None) -> dict[str, Any]:
        """The signed task record of a run that ended its sandbox (taskrecord.py)."""
        ttl = rec.expires_at - rec.started_at if rec.expires_at else self.s.default_ttl_s
        return self.recorder.write(
            rec, export_dir=spec.export_dir, policy_version=policy_version,
            labels=dict(spec.labels),
            isolation=backend_details(isolation, self.s), selftest=self.fence.pop(rec.task_id),
            limits=limits_of(profile.limits, ttl), ended_by=ended_by, exit_code=exit_code)

    def list(self) -> list[dict[str, Any]]:
        return [r.summary() for r in self.state.read().values()]

    def kill(self, task_id: str, ended_by: EndedBy = "killed") -> bool:
        """Kill and remove a sandbox (from any launcher process); False when unknown.
        `ended_by`: what its end says (a session the service expires: `ttl`)."""
        rec = self.state.read().get(task_id)
        live = self._live.get(task_id)
        if rec is None and live is None:
            return False
        self._emit(operator_event(rec or (live.record if live else None), task_id, "kill"))
        if self.pools is not None and self.pools.forget(task_id):
            self._teardown(task_id)  # a waiting pooled sandbox: no task, no end event
            return True
        if live is not None:
            live.ended_as = ended_by
            live.killed.set()
            live.backend.kill(live.cg, live.proc)
            return True
        assert rec is not None
        if not kill_elsewhere(rec, self.s, self.state):
            self.end_orphan(task_id, ended_by)  # the owner is gone (or slow)
        return True

    def suspend(self, task_id: str) -> bool:
        return self._freeze(task_id, True)

    def resume(self, task_id: str) -> bool:
        return self._freeze(task_id, False)

    def _freeze(self, task_id: str, frozen: bool) -> bool:
        return freeze(self.state, self.s, task_id, frozen, self._emit)

    def reconcile(self) -> dict[str, list[str]]:
        """Remove everything of this launcher's naming that no live launcher owns."""
        self._retry_deregistrations()
        return self.cleaner.reconcile(self.end_orphan)

    def _retry_deregistrations(self) -> None:
        retry_pending(self.state, self._deregister)

    def _deregister(self, task_id: str, sockets: list[str]) -> list[str]:
        failed = deregister(task_id, sockets) if self.register_tasks else []
        self.deregister_failures += len(failed)
        return failed

    def end_orphan(self, task_id: str, ended_by: EndedBy = "orphaned") -> None:
        """Tear down a sandbox whose run is gone (reconcile) or did not answer a kill
        from outside; if this removed its record, nobody else will say it ended."""
        gone = self._teardown(task_id)
        if end_due(gone):
            self._emit(end_event(gone, ended_by,
                                 accounting=self.bypass.end_accounting(gone)))

    def denials(self, task_id: str, since: int = 0) -> list[dict[str, Any]]:
        return self.bypass.denials(task_id, since)

    def denials_mark(self, task_id: str) -> int:
        return self.bypass.denials_mark(task_id)

    def handle_log_record(self, r: LogRecord) -> dict[str, Any] | None:
        return self.bypass.handle_log_record(r)

    def _profile(self, name: str, ruleset: Any) -> Any:
        if ruleset is None:
            from stockade.policy import load_rules  # type: ignore[attr-defined]

            ruleset = load_rules(self.config.rules_dir)
        return profile_of(ruleset, name)

    def _create(self, spec: SandboxSpec, profile: Any, policy_version: str | None,
                isolation: dict[str, Any], backend: Backend) -> Live:
        proxy_env = check_spec(spec, profile, self.config.gateway.proxy_listen)
        inputs = check_inputs(spec.inputs, self.s.ro_binds)
        limits = profile.limits
        ttl = min(spec.ttl, limits.ttl) if spec.ttl else limits.ttl
        live = self.claims.claim(profile.name, ttl, isolation["isolation"], backend)
        rec, task_id = live.record, live.record.task_id
        if spec.labels:
            self._labels[task_id] = dict(spec.labels)
        with self._undone_on_error(task_id):  # a gated tier boots before the fence: launch
            a, etc = self._wire(live, limits, profile.name, proxy_env, lambda a, etc: launch(
                backend, live, spec, self._context(a, etc, inputs, limits, profile, self._env(
                    spec, a.host_ip, proxy=proxy_env, trust=etc.trust_vars))))
            if self.register_tasks:
                register_task(Task(task_id, a.guest_ip, profile.name,
                              expires_at=rec.started_at + ttl + 5,
                              labels=dict(spec.labels)),
                              self._control_sockets(), live.registered)
            fence, ctx = self._begin(live, spec, profile, policy_version, a, etc, inputs,
                                     proxy_env)
            backend.start(live, spec, ctx)
            self.claims.running(live)
        self._emit(start_event(rec, policy_version, ttl, isolation, fence.as_dict()))
        return live

    def _begin(self, live: Live, spec: SandboxSpec, profile: Any, policy_version: str | None,
               a: SlotAddresses, etc: rootfs.Etc, inputs: list[Any],
               proxy_env: bool) -> tuple[Any, StartContext]:
        """What a cold start and a claim share between the task's registration and its
        command: the fence self-test (FenceUnverified: the caller tears the sandbox down),
        then the command's start context. (The self-test's report, the context.)"""
        fence = self.fence.check(live.record, profile, a, tap=bool(live.backend.tap),
                                 policy_version=policy_version)
        ctx = self._context(a, etc, inputs, profile.limits, profile,
                            self._env(spec, a.host_ip, proxy=proxy_env, trust=etc.trust_vars))
        if fence.pending:  # a microVM: its guest runs the probes once booted
            ctx = dataclasses.replace(ctx, selftest=self.fence.guest(
                live.record, profile, a, policy_version, fence))
        # only a session takes more commands: its execs need what its start got
        live.ctx = ctx if spec.session else None
        return fence, ctx

    def _warm(self, shape: Shape) -> Live:
        """One warm-pool sandbox of `shape`: every piece made, registered as pooled (all
        its traffic denied as `unclaimed`), its backend's setup done, no task."""
        backend = backend_for(shape.backend)
        assert pooled(backend)
        isolation = PROVIDED_ISOLATION if shape.backend == "netns" else shape.backend
        live = self.claims.claim("", None, isolation, backend, pool=shape.label())
        task_id = live.record.task_id
        with self._undone_on_error(task_id):
            a, etc = self._wire(live, shape, "", proxy=False)
            if self.register_tasks:
                register_task(Task(task_id, a.guest_ip, "", pooled=True),
                              self._control_sockets(), live.registered)
            live.warm_etc = etc
            backend.start_pooled(live, self._context(a, etc, [], shape, None, {}))
            self.claims.running(live, "pooled")
        return live

    def _claim_warm(self, backend_name: str, spec: SandboxSpec, profile: Any,
                    policy_version: str | None, isolation: dict[str, Any]) -> Live | None:
        """A warm-pool sandbox of the profile's tier and shape bound to this task (its
        registration with the task's profile and labels, the fence self-test, then its
        command); None when there is none."""
        if self.pools is None:
            return None
        backend = backend_for(backend_name)
        if not pooled(backend) or (spec.inputs and not backend.claims_inputs):
            return None  # this tier's pooled sandboxes cannot take the task: a cold start
        # checked first: a refused task must not use up a warm sandbox
        proxy_env = check_spec(spec, profile, self.config.gateway.proxy_listen)
        inputs = check_inputs(spec.inputs, self.s.ro_binds)
        if inputs and callable(check := getattr(backend, "check_claim", None)):
            check(inputs)  # the tier's own refusals of what its claim copies
        live = self.pools.take(shape_of(backend_name, profile.limits))
        if live is None:
            return None
        rec, task_id = live.record, live.record.task_id
        ttl = min(spec.ttl, profile.limits.ttl) if spec.ttl else profile.limits.ttl
        with self._undone_on_error(task_id):
            bound = self.claims.bind(live, profile.name, ttl)
        if not bound:  # killed while it waited (`sandbox kill`): this task starts cold
            self._teardown(task_id)
            return None
        if spec.labels:
            self._labels[task_id] = dict(spec.labels)
        with self._undone_on_error(task_id):
            a, etc = slot_addresses(self.s.address_pool, rec.slot), live.warm_etc
            self.bypass.ifindex[rec.ifindex] = (task_id, profile.name)
            if proxy_env:
                nft.run(nft.element_commands(self.s.nft_table, "add",
                                             [wiring(rec, proxy=True)]))
            if self.register_tasks:  # the pooled registration becomes the task's
                register_task(Task(task_id, a.guest_ip, profile.name,
                              expires_at=rec.started_at + ttl + 5,
                              labels=dict(spec.labels)),
                              self._control_sockets(), [])
            # as a cold start: the fence proven (now that the gateway, the DNS firewall and
            # the broker know the task's profile) before the init gets the command
            fence, ctx = self._begin(live, spec, profile, policy_version, a, etc, inputs,
                                     proxy_env)
            backend.claim_pooled(live, spec, ctx)
            self.claims.running(live)
        self._emit(start_event(rec, policy_version, ttl, {**isolation, "pool": rec.pool},
                               fence.as_dict()))
        return live

    def _wire(self, live: Live, limits: Any, profile: str, proxy: bool,
              early: Callable[[SlotAddresses, rootfs.Etc], None] | None = None,
              ) -> tuple[SlotAddresses, rootfs.Etc]:
        """Cgroups, scratch and /etc, netns and veth (or tap), `early(a, etc)`, nft elements."""
        rec = live.record
        a = slot_addresses(self.s.address_pool, rec.slot)
        live.backend.create(live, limits, self.s)
        etc = rootfs.prepare(Path(rec.scratch), limits.disk, a.host_ip, self.s, self.config)
        rec.ifindex = netns.create(rec.netns, rec.ifname, a, tap=live.backend.tap)
        self.bypass.ifindex[rec.ifindex] = (rec.task_id, profile)
        if early is not None:
            early(a, etc)
        nft.run(nft.element_commands(self.s.nft_table, "add", [wiring(rec, proxy=proxy)]))
        return a, etc

    def _context(self, a: SlotAddresses, etc: rootfs.Etc, inputs: list[Any], limits: Any,
                 profile: Any, env: dict[str, str]) -> StartContext:
        """The backend's start context; `profile` None: a warm-pool sandbox, no filter."""
        python = self._init_python()
        return StartContext(
            settings=self.s, addresses=a, inputs=inputs, etc=etc, limits=limits, env=env,
            init_python=python, congestion_control=self._congestion_control,
            seccomp=(lambda: seccomp_program(python, profile)) if profile is not None
            else _no_task_filter,
            state_dir=Path(self.config.state_dir) / "launcher", emit=self._emit)

    @contextlib.contextmanager
    def _undone_on_error(self, task_id: str) -> Iterator[None]:
        """A sandbox that fails on its way up is torn down whole, whatever failed."""
        try:
            yield
        except BaseException as e:
            self._teardown(task_id)
            self._labels.pop(task_id, None)
            if isinstance(e, StateWriteError):
                raise LauncherError(f"cannot write the launcher state {e.path}: {e}") from None
            raise

    def _init_python(self) -> str:
        # the sandbox can read its pid 1's argv: prefer the system interpreter's plain path
        p = self.s.init_python
        return p if p and os.access(p, os.X_OK) else sys.executable

    def _env(self, spec: SandboxSpec, host_ip: str, proxy: bool = False,
             trust: dict[str, str] | None = None) -> dict[str, str]:
        """The command's environment; `proxy`: the profile's `egress.proxy_env`."""
        if proxy and self.params.proxy_port is None:
            raise LauncherError("egress.proxy_env needs gateway.proxy_listen")
        return sandbox_env(spec, host_ip, self.s.env_allowlist, self.params.broker_port,
                           self.params.proxy_port if proxy else None, trust)

    def _control_sockets(self) -> list[str]:
        return [self.config.gateway.control_socket, self.config.broker.control_socket]

    def _teardown(self, task_id: str) -> SandboxRecord | None:
        return self.cleaner.teardown(task_id)

    def _emit(self, event: dict[str, Any]) -> None:
        self.events.write(event)


def _no_task_filter() -> bytes:
    raise LauncherError("a warm-pool sandbox has no task, so no profile's seccomp filter")
