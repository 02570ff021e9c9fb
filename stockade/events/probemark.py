"""The fence self-test's marker names (launcher/selftest.py sends them; the event
throttle, summary.py, recognises their events so probes never spend a task's budgets).

They live in a zone that can never resolve (RFC 6761 `.invalid`): no rule allows them
and no resolver answers them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MARKER_ZONE = "stockade-fence-probe.invalid"
_ZONE_LABELS = tuple(MARKER_ZONE.encode().split(b"."))
# a task's probe events (or DNS queries) kept off its budgets: one self-test makes about
# ten; a sandbox that names markers itself gains no more than this
PROBES_PER_TASK = 32


def marker(role: str, task_id: str) -> str:
    return f"{role}.{task_id}.{MARKER_ZONE}"


def is_marker(name: object) -> bool:
    return isinstance(name, str) and name.rstrip(".").endswith("." + MARKER_ZONE)


def is_marker_labels(labels: tuple[bytes, ...]) -> bool:
    """A DNS question's labels (as received, any case) name a marker."""
    n = len(_ZONE_LABELS)
    return len(labels) > n and tuple(x.lower() for x in labels[-n:]) == _ZONE_LABELS


# the probes whose events cannot name a marker, by (component, action, decision), and
# whether their destination must be one of the self-test's target addresses: TLS without
# SNI to the raw address (the gateway's denial), the UDP datagram (the NFLOG reader's
# bypass attempt), the query for a name the profile allows (the DNS firewall's answer)
UNMARKED_PROBES = {("gateway", "connection_decision", "denied"): True,
                   ("launcher", "bypass_attempt", "denied"): True,
                   ("dns", "dns_decision", "allowed"): False}
Kind = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class ProbeWindow:
    """Where and when a task's unmarked probe events come: to `targets` (launcher.selftest's
    addresses), within `window_s` of the task's first event (the probe and evidence
    deadlines: the self-test is the first thing a task does). 0: none are recognised."""

    targets: frozenset[str] = frozenset()
    window_s: float = 0.0


def window_of(selftest: Any) -> ProbeWindow:
    """The window of a `launcher.selftest` section (its model or configpeek's values):
    its three target addresses, its probe and evidence deadlines."""
    return ProbeWindow(frozenset({selftest.raw_ip, selftest.outside_resolver,
                                  selftest.ipv6_address}),
                       selftest.probe_timeout_s + selftest.evidence_timeout_s)


def _get(ev: dict[str, Any], a: str, b: str) -> Any:
    part = ev.get(a)
    return part.get(b) if isinstance(part, dict) else None


def destination_address(ev: dict[str, Any]) -> Any:
    """The address the flow was sent to: the gateway reports a refused flow's (it dialled
    nothing) as the original destination, `ip:port`."""
    ip = _get(ev, "destination", "ip")
    orig = _get(ev, "stockade", "original_destination")
    if ip or not isinstance(orig, str):
        return ip
    return orig.rsplit(":", 1)[0].strip("[]")


def unmarked_probe_kind(ev: dict[str, Any], targets: frozenset[str]) -> Kind | None:
    """The UNMARKED_PROBES kind of an event that may be such a probe's, else None."""
    kind = (str(_get(ev, "stockade", "component")), str(_get(ev, "event", "action")),
            str(_get(ev, "stockade", "decision")))
    return probe_kind(kind, _get(ev, "destination", "domain"), destination_address(ev),
                      targets)


def probe_kind(kind: Kind, domain: object, address: object,
               targets: frozenset[str]) -> Kind | None:
    """`kind` if an event of that kind, destination domain and address may be an
    unmarked probe's, else None (the parts of unmarked_probe_kind, for a caller that
    has not built the event)."""
    to_target = UNMARKED_PROBES.get(kind)
    if to_target is None:
        return None
    if to_target and (domain or address not in targets):
        return None
    return kind


NO_WINDOW = ProbeWindow()  # no unmarked probe is recognised
