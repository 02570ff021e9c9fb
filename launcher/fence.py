"""The fence self-test of one start: plan (selftest.py), probe (probes.py from the
sandbox's namespace; a microVM's from inside its guest, vmprobes.py, once the backend has
booted it: `Fence.guest`), wait for the events the probes caused, judge. A fence that
holds (or a test that was sampled out) is reported in the start event's
`stockade.selftest`; one that does not gets a `sandbox_lifecycle` event of its own
(`stockade.lifecycle = selftest`, reason `fence_unverified`, naming the probes) and
`FenceUnverified`: `Launcher._create` tears the sandbox down and the task fails.

Either event says when the last probe's event was in (`until`): the sandbox runs no
process before then, so `selftest.without_probe_events` tells the probes' events in the
task's store from the command's (the run's denials and the task record leave them out).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stockade.events import make_event, timestamp
from stockade.events.taskstore import read_task_events

from . import nft
from .addresses import SlotAddresses
from .selftest import (
    FENCE_UNVERIFIED,
    SELFTEST,
    Observation,
    Probe,
    ProbeResult,
    Report,
    ServicePorts,
    judge,
    pending_evidence,
    plan,
    should_run,
)
from .spec import LauncherError
from .state import SandboxRecord

Event = dict[str, Any]
# runs probes where they must start from (the namespace, or a guest): name -> what it saw
Runner = Callable[[list[Probe], float], dict[str, Observation]]


MAX_REPORTS = 4096  # reports kept for task records still to be written


class FenceUnverified(LauncherError):
    """The fence did not hold for one or more probes (named in the message)."""


def _port(listen: Any) -> int | None:
    if not isinstance(listen, str) or ":" not in listen:
        return None
    try:
        return int(listen.rsplit(":", 1)[1])
    except ValueError:
        return None


def service_ports(config: Any, broker_port: int) -> ServicePorts:
    """The broker port and the control planes' TCP listeners (metrics) of the config."""
    control = [_port(getattr(getattr(config, c, None), "metrics_listen", None))
               for c in ("gateway", "broker")]
    return ServicePorts(broker=broker_port, control=tuple(sorted({p for p in control if p})))


def failure_event(rec: SandboxRecord, report: Report, policy_version: str | None) -> Event:
    """The event of a start refused by its self-test (one that passes, or was skipped, is
    reported in the start event: launcher/lifecycle.py)."""
    msg = "fence self-test failed: " + "; ".join(f"{r.probe}: {r.why}"
                                                 for r in report.failed())
    return make_event(
        component="launcher", action="sandbox_lifecycle", decision="denied",
        reason=FENCE_UNVERIFIED, task_id=rec.task_id, profile=rec.profile,
        policy_version=policy_version, source_ip=rec.guest_ip, message=msg,
        extra={"lifecycle": SELFTEST, SELFTEST: report.as_dict()})


class Fence:
    """The self-test of every start of one launcher; `emit` writes its events."""

    def __init__(self, config: Any, broker_port: int, emit: Callable[[Event], None],
                 publish: Callable[[SandboxRecord], None], reading: Callable[[], bool]) -> None:
        """`publish`: puts a sandbox's ifindex in the shared state before its probes;
        `reading`: this process's NFLOG reader holds the group (else another one may, or
        none: then the fence's nft counter is the UDP probe's evidence)."""
        self.s = config.launcher.selftest
        self.table = config.launcher.nft_table
        self.task_events_dir = Path(config.task_events_dir)
        self.ports = service_ports(config, broker_port)
        self.emit, self.publish, self.reading = emit, publish, reading
        self.reports: dict[str, Report] = {}  # task id -> its report, until the record

    def check(self, rec: SandboxRecord, profile: Any, a: SlotAddresses, tap: bool,
              policy_version: str | None) -> Report:
        """Probe the fence of a sandbox that is wired but not started: its report (for
        the start event and the task record, `pop`), or FenceUnverified after the
        failure's event. `tap`: a microVM, whose guest probes once booted: the report is
        `pending` until the backend runs `guest(...)`."""
        if not should_run(getattr(profile, "selftest", "required"), self.s.sample_rate):
            report = Report(skipped=f"sampled out (launcher.selftest.sample_rate "
                                    f"{self.s.sample_rate})")
        elif tap:
            report = Report(pending=True)
        else:
            # imported here, not at the top: the probes load dnspython and ssl, which
            # `stockade sandbox kill|suspend|resume` (a Launcher that starts nothing) must
            # not pay for
            from .probes import run_probes

            report = self._measured(rec, profile, a, functools.partial(run_probes, rec.netns))
        self._conclude(rec, report, policy_version)
        return report

    def guest(self, rec: SandboxRecord, profile: Any, a: SlotAddresses,
              policy_version: str | None, report: Report) -> Callable[[Runner], None]:
        """The self-test of a microVM's pending `report`, for its backend to run once the
        guest can run probes (with the guest's runner): fills `report` in, or
        FenceUnverified after the failure's event (the caller tears the sandbox down)."""
        def run(runner: Runner) -> None:
            done = self._measured(rec, profile, a, runner)
            report.results, report.until = done.results, done.until
            report.duration_s, report.pending = done.duration_s, False
            self._conclude(rec, report, policy_version)
        return run

    def _measured(self, rec: SandboxRecord, profile: Any, a: SlotAddresses,
                  runner: Runner) -> Report:
        t0 = time.monotonic()
        report = self._probe(rec, profile, a, runner)
        report.duration_s = time.monotonic() - t0
        return report

    def _conclude(self, rec: SandboxRecord, report: Report, policy_version: str | None) -> None:
        if report.skipped is None and not report.pending and not report.passed:
            self.emit(failure_event(rec, report, policy_version))
            names = ", ".join(f"{r.probe} ({r.outcome}"
                              f"{', not logged' if r.evidence is False else ''})"
                              for r in report.failed())
            raise FenceUnverified(f"{FENCE_UNVERIFIED}: the sandbox's fence did not hold "
                                  f"for probe(s) {names}; the task was not started")
        if len(self.reports) >= MAX_REPORTS:  # starts that failed later never pop theirs
            self.reports.pop(next(iter(self.reports)))
        self.reports[rec.task_id] = report

    def _probe(self, rec: SandboxRecord, profile: Any, a: SlotAddresses,
               runner: Runner) -> Report:
        from .probes import ProbeSetupError  # on use, as run_probes in check()

        probes = plan(profile, rec.task_id, a.host_ip, self.ports, self.s)
        self.publish(rec)  # another launcher's NFLOG reader reports the UDP probe
        counter = None if self.reading() else nft.bypass_count(self.table, rec.ifname)
        try:
            seen = runner(probes, self.s.probe_timeout_s)
        except ProbeSetupError as e:  # nothing probed: the fence is not shown to hold
            return Report([ProbeResult(Observation("setup", "error:setup"), False, str(e))],
                          until=timestamp())
        deadline = time.monotonic() + self.s.evidence_timeout_s
        counted = False
        while True:
            events = read_task_events(self.task_events_dir, rec.task_id)
            if counter is not None and not counted:
                counted = nft.bypass_count(self.table, rec.ifname) > counter
            if not pending_evidence(probes, seen, events, counted) or \
                    time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        return Report(judge(probes, seen, events, counted), until=timestamp())

    def pop(self, task_id: str) -> Report | None:
        return self.reports.pop(task_id, None)
