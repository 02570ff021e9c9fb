"""Which way a decided flow goes: refused, to the L7 inspector, over the early dial of
its CONNECT, or dialled now. Pure, apart from the memo of CONNECT verdicts."""

from __future__ import annotations

from dataclasses import replace
from datetime import date
from typing import Any, Literal, NamedTuple

from stockade.policy.decide import utc_today
from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from ..flow import FlowDecision, FlowInput, decide_flow
from ..sniff_http import BODYLESS_METHODS, RequestHead, body_length
from .flight import Sniffed

VERDICT_CACHE_SIZE = 4096  # memoised CONNECT verdicts (see ConnectVerdicts)
Action = Literal["refuse", "inspect", "early", "dial"]


class Route(NamedTuple):
    action: Action
    decision: FlowDecision  # for "refuse": the denial, detail included


class InspectorState(NamedTuple):
    """What the route needs to know of the L7 inspector, read once per decision."""

    present: bool  # inspection is enabled
    ready: bool
    why: str  # why it is not ready ("" when it is)

    @classmethod
    def of(cls, inspector: Any) -> InspectorState:
        if inspector is None:
            return cls(False, False, "")
        return cls(True, bool(inspector.ready), inspector.why)


class ConnectVerdicts:
    """`decide_flow` for a CONNECT authority alone, memoised per rule set, profile,
    authority and UTC day (it is pure in exactly those: entries expire by date). A task
    names the same few authorities on every connection. Bounded: cleared when full, so
    distinct names can churn it but not grow it."""

    def __init__(self) -> None:
        self._verdicts: dict[tuple[str, str, date], FlowDecision] = {}
        self._for: RuleSet | None = None

    def get(self, head: RequestHead, ruleset: RuleSet, profile: str) -> FlowDecision:
        if ruleset is not self._for:
            self._verdicts.clear()
            self._for = ruleset
        today = utc_today()
        key = (profile, head.target, today)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if len(self._verdicts) >= VERDICT_CACHE_SIZE:
                self._verdicts.clear()
            verdict = decide_flow(FlowInput("proxy", connect=head), ruleset, profile, today)
            self._verdicts[key] = verdict
        return verdict


def inspectable(d: FlowDecision, state: InspectorState, protocol: str = "tls") -> bool:
    """Does this flow go to the L7 inspector? A named TLS flow whose matching allow
    entries are all inspected (an `http` block, or `host_must_match_sni`: denied
    `inspection_unavailable`, or let through in report mode), while the inspector is
    up. Everything else never touches it."""
    return (
        d.reason == Reason.INSPECTION_UNAVAILABLE
        and d.protocol == protocol
        and d.host is not None
        and d.ip is None
        and state.present
        and state.ready
    )


def why_uninspected(d: FlowDecision, state: InspectorState) -> FlowDecision:
    """A denial `inspection_unavailable` with the inspector's state in its detail."""
    if d.reason != Reason.INSPECTION_UNAVAILABLE:
        return d
    d = replace(d, allowed=False, report_only=False)  # enforced in report mode too
    if not state.present:
        why = "L7 inspection is disabled (gateway.inspection.enabled)"
    elif d.protocol == "http":
        why = "the plain-HTTP request head gives no path to decide on"
    else:
        why = state.why or "the inspector is not ready"
    return replace(d, detail=f"{d.detail}: {why}" if d.detail else why)


def refuse_framing(d: FlowDecision, inner: Sniffed) -> FlowDecision:
    """Only the first request of a plain-HTTP connection is decided, and the relay
    forwards exactly its head and body: a body it cannot count is refused, and so is a
    body on a GET or HEAD."""
    if not (d.allowed and d.protocol == "http" and inner.http is not None):
        return d
    length = body_length(inner.http)
    if length is None:
        detail = "plain-HTTP request body without a plain Content-Length (chunked)"
    elif length and inner.http.method in BODYLESS_METHODS:
        detail = f"a {inner.http.method} request with a body"
    else:
        return d
    return replace(
        d,
        allowed=False,
        reason=Reason.PROTOCOL_UNRECOGNISED,
        report_only=False,
        detail=detail,
    )


def connect_route(pre: FlowDecision, state: InspectorState) -> tuple[FlowDecision | None, bool]:
    """A CONNECT authority's verdict, before the 200: (the denial to send, or None; does
    the tunnel go to the inspector). The inspector decides per request, not this (a
    CONNECT alone is "tcp")."""
    l7 = pre.reason is Reason.INSPECTION_UNAVAILABLE and inspectable(pre, state, "tcp")
    if (not pre.allowed or pre.reason is Reason.INSPECTION_UNAVAILABLE) and not l7:
        return why_uninspected(pre, state), l7
    return None, l7


def choose_route(
    d: FlowDecision, pre: FlowDecision | None, early: bool, state: InspectorState
) -> Route:
    """`pre`: the CONNECT authority's verdict; `early`: a dial of it is under way."""
    if d.reason is Reason.INSPECTION_UNAVAILABLE and inspectable(d, state):
        # method/path rules on a TLS flow: resolved and checked here, decided per
        # request by the inspector (gateway/inspector/)
        return Route("inspect", d)
    if not d.allowed or d.reason is Reason.INSPECTION_UNAVAILABLE:
        # (report mode lets a policy denial through, never a flow that needs the
        # inspector while it is down or disabled: the Host/SNI checks inside TLS and
        # the per-request decisions would be skipped)
        return Route("refuse", why_uninspected(d, state))
    if early and pre is not None and (pre.host, pre.ip, pre.port) == (d.host, d.ip, d.port):
        return Route("early", d)  # the name passed the guards already
    return Route("dial", d)
