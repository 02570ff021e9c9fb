"""The fence self-test, pure part: which probes a sandbox runs before its command starts,
what each must see, and the verdict over what the probes saw and the events they caused.

A probe is one connection or datagram from inside the sandbox's network namespace
(launcher/probes.py runs them). Every forbidden probe must fail the way the design says:
refused or answered with a denial, *and* logged, i.e. an event of the component that
enforces it (gateway, DNS firewall, the launcher's NFLOG reader) is in the task's event
store, matched by the probe's source port or marker name. A probe that connects, gets a
real answer, hangs, or leaves no event fails the fence: the start is refused with
`fence_unverified` (launcher/fence.py). Marker names (`MARKER_ZONE`) make the probes
recognisable in the events; `is_probe_event` is how the run's denials leave them out.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# marker names (their zone can never resolve) are shared with the event throttle
from stockade.events.probemark import MARKER_ZONE, is_marker, marker

__all__ = ["MARKER_ZONE", "marker"]  # the names' home is stockade/events/probemark.py

Kind = Literal["dns", "tls", "http", "udp", "tcp6"]
Event = dict[str, Any]

FENCE_UNVERIFIED = "fence_unverified"
SELFTEST = "selftest"  # `stockade.lifecycle` of the self-test's event
# what a refused flow looks like from inside the sandbox
REFUSED = frozenset({"closed", "reset", "refused", "unreachable"})
DNS_DENIED = frozenset({"answer:REFUSED", "answer:NXDOMAIN"})
# the gateway's codes for a flow without a usable name (a raw IP, a host service)
NAMELESS = frozenset({"sni_missing", "address_forbidden", "no_matching_rule", "invalid_host",
                      "protocol_unrecognised"})


@dataclass(frozen=True, slots=True)
class Evidence:
    """The event a probe must cause (in the task's store)."""

    component: str
    action: str
    reasons: frozenset[str] = frozenset()  # empty: any reason code
    decision: str = "denied"


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe to `host`:`port`. `ok`: the outcomes that count as the fence holding;
    `qname`: the DNS question, the TLS SNI or the HTTP Host; `evidence`: the event it
    must cause (None: nothing leaves the namespace to be logged); `why`: what it checks,
    for the event."""

    name: str
    kind: Kind
    host: str
    port: int
    ok: frozenset[str]
    qname: str | None = None
    evidence: Evidence | None = None
    why: str = ""


@dataclass(frozen=True, slots=True)
class Observation:
    """What one probe saw. `outcome`: answer:<RCODE>, denied:<reason> (an HTTP 403 of
    the gateway), closed, reset, refused, unreachable, timeout, connected, handshake (a
    TLS handshake that completed), reply (a UDP answer), error:<what>."""

    probe: str
    outcome: str
    source_port: int | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The verdict on one probe: what it saw, whether that and its event (`evidence`:
    found, not found, or None when the probe needs none) show the fence holding."""

    seen: Observation
    passed: bool
    why: str
    evidence: bool | None = None

    @property
    def probe(self) -> str:
        return self.seen.probe

    @property
    def outcome(self) -> str:
        return self.seen.outcome

    def as_dict(self) -> dict[str, Any]:
        return {"probe": self.probe, "passed": self.passed, "outcome": self.outcome,
                "evidence": self.evidence, "why": self.why}


@dataclass(frozen=True, slots=True)
class ServicePorts:
    """Host-side ports the plan probes: the broker's (exempt from the redirect on the
    host-side address only) and the TCP listeners of the services' control planes."""

    broker: int
    control: tuple[int, ...] = ()
    host_service: int = 22  # sshd: a host service no sandbox may reach


@dataclass
class Report:
    """The self-test of one start: results in plan order, how long it took."""

    results: list[ProbeResult] = field(default_factory=list)
    duration_s: float = 0.0
    skipped: str | None = None  # why it did not run (sampled out)
    pending: bool = False  # a microVM's, until its guest has booted and run the probes
    # the time (events' @timestamp format) once every probe's event was in: the task has
    # no process before then, so each of its events up to it is a probe's
    until: str = ""

    @property
    def passed(self) -> bool:
        return not self.pending and all(r.passed for r in self.results)

    def failed(self) -> list[ProbeResult]:
        return [r for r in self.results if not r.passed]

    def as_dict(self) -> dict[str, Any]:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        return {"passed": self.passed, "duration_s": round(self.duration_s, 6),
                "until": self.until, "probes": [r.as_dict() for r in self.results]}


def should_run(mode: str, sample_rate: float, rng: random.Random | None = None) -> bool:
    """`selftest: required` always; `sampled` on `sample_rate` of the starts."""
    if mode == "required":
        return True
    return (rng or random).random() < sample_rate


def allowed_name(profile: Any) -> str | None:
    """One name the profile allows outright (no wildcard, not L7-inspected), if any."""
    for entry in getattr(profile, "allow", ()):
        host = getattr(entry, "host", None)
        if host and "*" not in host and getattr(entry, "http", None) is None:
            return str(host)
    return None


def plan(profile: Any, task_id: str, host_ip: str, ports: ServicePorts,
         settings: Any) -> list[Probe]:
    """The probes of one start. `settings`: launcher.selftest (SelftestSettings)."""
    raw, v6 = settings.raw_ip, settings.ipv6_address
    gw_denied = Evidence("gateway", "connection_decision")
    probes: list[Probe] = []
    enforce = getattr(profile, "mode", "enforce") == "enforce"

    def host(role: str) -> str | None:
        # an HTTP probe's Host: a marker (its events then never spend the task's event
        # budget, stockade/events/summary.py) where names are denied; a report-only
        # profile lets names through, so there it stays the address
        return marker(role, task_id) if enforce else None

    if enforce:
        # report-only profiles let names through by design: only the network fence applies
        probes += [
            Probe("dns_denied_name", "dns", host_ip, 53, DNS_DENIED, marker("dns", task_id),
                  Evidence("dns", "dns_decision", frozenset({"no_matching_rule"})),
                  "a name the profile does not allow, through the DNS firewall"),
            Probe("tls_denied_name", "tls", raw, 443, REFUSED, marker("tls", task_id),
                  Evidence("gateway", "connection_decision", frozenset({"no_matching_rule"})),
                  "TLS with a name the profile does not allow as SNI"),
            Probe("outside_resolver", "dns", settings.outside_resolver, 53, DNS_DENIED,
                  marker("resolver", task_id),
                  Evidence("dns", "dns_decision", frozenset({"no_matching_rule"})),
                  "DNS to a resolver other than the DNS firewall"),
        ]
    probes += [
        Probe("raw_ip", "tls", raw, 443, REFUSED, None, Evidence(
            "gateway", "connection_decision", NAMELESS), "TLS to a raw IP without a name"),
        Probe("udp", "udp", raw, 443, REFUSED | {"timeout"}, None,
              Evidence("launcher", "bypass_attempt", frozenset({"bypass_attempt"})),
              "UDP (QUIC) to a raw IP"),
        Probe("host_service", "http", host_ip, ports.host_service, REFUSED | {"denied:*"},
              host("host"), gw_denied, "a host service port on the sandbox's gateway address"),
        Probe("exempt_port_elsewhere", "http", raw, ports.broker, REFUSED | {"denied:*"},
              host("exempt"), gw_denied, "the broker's port on another address (only the host-side "
              "address is exempt from the redirect)"),
        # the namespace has no IPv6 address or route: nothing leaves it, nothing to log
        Probe("ipv6", "tcp6", v6, 443, REFUSED, None, None, "IPv6"),
    ]
    probes += [Probe(f"control_tcp_{p}", "http", host_ip, p, REFUSED | {"denied:*"},
                     host(f"control{p}"), gw_denied,
                     "a control plane's TCP listener on the gateway address")
               for p in ports.control]
    name = allowed_name(profile)
    if name is not None:
        probes.append(Probe("allowed_name", "dns", host_ip, 53, frozenset({"answer:NOERROR"}),
                            name, None, "a name the profile allows resolves"))
    return probes


def _field(ev: Event, *path: str) -> Any:
    cur: Any = ev
    for p in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def _names_probe(ev: Event, probe: Probe, obs: Observation) -> bool:
    """The event is about this probe's flow: its marker name, its destination (the
    gateway reports the address it was asked for, as domain or IP), or its source port
    (which NAT may have changed: a slot's earlier sandbox left conntrack entries)."""
    if probe.qname is not None and (
            str(_field(ev, "dns", "question", "name") or "").rstrip(".") == probe.qname or
            _field(ev, "destination", "domain") == probe.qname):
        return True
    if probe.kind == "dns":
        return False  # the DNS firewall's events name the question, checked above
    dst = (_field(ev, "destination", "domain"), _field(ev, "destination", "ip"))
    # an HTTP probe's marker is only its Host: a gateway that refuses before reading it
    # reports the address
    if _field(ev, "destination", "port") == probe.port and (
            probe.qname is None or probe.kind == "http") and (
            probe.host in dst or dst == (None, None)):
        return True
    return obs.source_port is not None and _field(ev, "source", "port") == obs.source_port


def evidence_of(probe: Probe, obs: Observation, events: Iterable[Event],
                counted: bool = False) -> bool:
    """An event of the task's store shows the probe's denial. `counted`: the fence's log
    rule counted the sandbox's packets (nft's counter), which stands for the NFLOG
    reader's event when no reader holds the group (the end event's summary reports them)."""
    want = probe.evidence
    if want is None:
        return True
    if counted and want.component == "launcher" and want.action == "bypass_attempt":
        return True
    for ev in events:
        if _field(ev, "stockade", "component") != want.component or \
                _field(ev, "event", "action") != want.action or \
                _field(ev, "stockade", "decision") != want.decision:
            continue
        if want.reasons and _field(ev, "event", "reason") not in want.reasons:
            continue
        if _names_probe(ev, probe, obs):
            return True
    return False


def outcome_ok(probe: Probe, outcome: str) -> bool:
    if outcome in probe.ok:
        return True
    return outcome.startswith("denied:") and "denied:*" in probe.ok


def judge(probes: list[Probe], seen: Mapping[str, Observation], events: list[Event],
          counted: bool = False) -> list[ProbeResult]:
    """One result per probe, in plan order."""
    out = []
    for p in probes:
        obs = seen.get(p.name) or Observation(p.name, "error:not run")
        if not outcome_ok(p, obs.outcome):
            why = f"{p.why}: expected {' or '.join(sorted(p.ok))}, saw {obs.outcome}"
            if obs.detail:
                why += f" ({obs.detail})"
            out.append(ProbeResult(obs, False, why))
            continue
        if p.evidence is None:
            out.append(ProbeResult(obs, True, p.why))
            continue
        logged = evidence_of(p, obs, events, counted)
        codes = "/".join(sorted(p.evidence.reasons)) or "any reason"
        why = p.why if logged else (
            f"{p.why}: no {p.evidence.component} {p.evidence.action} event "
            f"({p.evidence.decision}, {codes}) for the probe")
        out.append(ProbeResult(obs, logged, why, logged))
    return out


def pending_evidence(probes: list[Probe], seen: Mapping[str, Observation],
                     events: list[Event], counted: bool = False) -> bool:
    """Some probe whose outcome is right still waits for its event."""
    return any(p.evidence is not None and p.name in seen and outcome_ok(p, seen[p.name].outcome)
               and not evidence_of(p, seen[p.name], events, counted) for p in probes)


def is_probe_event(ev: Event, until: str) -> bool:
    """An event the self-test caused: any but a lifecycle event up to `until`, and any
    that names a marker."""
    for name in (_field(ev, "destination", "domain"), _field(ev, "dns", "question", "name")):
        if is_marker(name):
            return True
    return _field(ev, "event", "action") != "sandbox_lifecycle" and \
        str(ev.get("@timestamp", "")) <= until


def without_probe_events(events: list[Event]) -> list[Event]:
    """The task's events without those its self-test caused (`is_probe_event`; `until`
    is in the event that reports the self-test: the start event, or the failure's own)."""
    mark = next((ev for ev in events
                 if isinstance((ev.get("stockade") or {}).get(SELFTEST), dict)), None)
    if mark is None:
        return events
    until = str(mark["stockade"][SELFTEST].get("until", ""))
    return [ev for ev in events if not is_probe_event(ev, until)]
