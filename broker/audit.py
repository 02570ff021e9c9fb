"""What the broker says about each call: the `broker_call` audit event (one per request,
denied or not), `secret_echo` when an upstream echoed the credential, and the rule reload
and Vault status events. The event builders are pure; `Auditor` writes them and counts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from stockade.policy.model import ApiDefinition, Profile
from stockade.policy.reasons import Reason

from stockade.events import EventWriter, make_event
from stockade.tasks import Task, TaskRegistry

from .metrics import ApiMetrics, BrokerMetrics
from .request import Upstream


class Rules(Protocol):
    """What the broker reads of a `stockade.policy.RuleSet`."""

    @property
    def version(self) -> str: ...
    @property
    def profiles(self) -> Mapping[str, Profile]: ...
    @property
    def apis(self) -> Mapping[str, ApiDefinition]: ...


@dataclass(slots=True)
class CallLog:
    """What the audit event of one call says; filled in as the call progresses."""

    t0: float
    source_ip: str
    task: Task | None = None
    api: str | None = None
    method: str | None = None
    path: str | None = None
    upstream: Upstream | None = None
    status: int | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    decision: str = "denied"
    reason: str = Reason.BAD_REQUEST
    scrubs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    response: web.StreamResponse | None = None  # pass-through: the prepared stream
    upstream_s: float | None = None  # the upstream call took this long (when made)
    metrics: ApiMetrics | None = None  # the API's metric children (when called)


def audit_event(cl: CallLog, rules_version: str, api: str | None,
                latency_ms: float) -> dict[str, Any]:
    """The call's `broker_call` event; `api` is the call's API name when the rules know
    it (an unknown name a caller made up is not echoed into the event)."""
    extra: dict[str, Any] = {
        "api": cl.api if api else None,
        "status": cl.status,
        "bytes_up": cl.bytes_up,
        "bytes_down": cl.bytes_down,
        "latency_ms": round(latency_ms, 3),
        **cl.extra,
    }
    up = cl.upstream
    return make_event(
        component="broker", action="broker_call", decision=cl.decision,  # type: ignore[arg-type]
        reason=str(cl.reason),
        destination_port=up.port if up else None,
        transport="tcp", protocol="http",
        extra={k: v for k, v in extra.items() if v is not None},
        **_call_fields(cl, rules_version),
    )


def secret_echo_event(cl: CallLog, rules_version: str, api: str) -> dict[str, Any]:
    return make_event(
        component="broker", action="secret_echo", decision=None,
        reason=Reason.SECRET_ECHO,
        message="upstream response echoed the credential; removed before the caller saw it",
        extra={"api": api, "scrubs": cl.scrubs},
        **_call_fields(cl, rules_version),
    )


def _call_fields(cl: CallLog, rules_version: str) -> dict[str, Any]:
    """What both events of a call say about it: who called, under which rules, what."""
    return {
        "task_id": cl.task.task_id if cl.task else None,
        "profile": cl.task.profile if cl.task else None,
        "policy_version": rules_version,
        "source_ip": cl.source_ip or None,
        "destination_domain": cl.upstream.host if cl.upstream else None,
        "http_method": cl.method, "http_status": cl.status,
        "url": {"path": cl.path[:2048]} if cl.path else None,
    }


def reload_refused_event(old: str, trigger: str, problems: list[str]) -> dict[str, Any]:
    # same event fields and reason codes as the gateway's reload
    return make_event(
        component="broker", action="rules_reload", decision="denied",
        reason="rules_invalid", policy_version=old,
        message=f"rule reload ({trigger}) refused; previous rules stay in force",
        extra={"problems": problems, "trigger": trigger},
    )


def reloaded_event(old: str, new: str, trigger: str) -> dict[str, Any]:
    return make_event(
        component="broker", action="rules_reload", decision="allowed",
        reason="rules_loaded", policy_version=new,
        message=f"rules reloaded ({trigger}): {old} -> {new}",
        extra={"trigger": trigger, "previous_version": old},
    )


def vault_status_event(state: str, cause: str) -> dict[str, Any]:
    return make_event(
        component="broker", action="vault_status",
        reason="vault_up" if state == "up" else Reason.VAULT_UNAVAILABLE,
        message=f"vault {state}" + (f" ({cause})" if cause else ""),
    )


class Auditor:
    """Writes a call's events and counts its metrics; `rules` is read per event (a reload
    swaps the broker's rules)."""

    def __init__(self, events: EventWriter, metrics: BrokerMetrics, registry: TaskRegistry,
                 clock: Callable[[], float], rules: Callable[[], Rules]) -> None:
        self.events = events
        self.metrics = metrics
        self.registry = registry
        self.clock = clock
        self.rules = rules
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once known

    def soon(self, cl: CallLog) -> None:
        """Write the call's audit event right after the answer went out: building and
        writing it is ~30 us that need not sit on the caller's latency; the callback runs
        on the loop's next turn, before any later I/O."""
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        loop.call_soon(self.write, cl)

    def write(self, cl: CallLog) -> None:
        rules = self.rules()
        api = cl.api if cl.api and cl.api in rules.apis else None
        self.metrics.call(api or "-", str(cl.reason))
        if cl.metrics is not None and cl.upstream_s is not None:
            cl.metrics.upstream_seconds.observe(cl.upstream_s)
            cl.metrics.bytes_down.inc(cl.bytes_down)
        latency_ms = (self.clock() - cl.t0) * 1000.0
        self.events.write(audit_event(cl, rules.version, api, latency_ms))

    def head_denied(self, source_ip: str, status: int, reason: str, error: str) -> None:
        """`HeadGuard`: a request refused before any handler ran (head too slow, too large
        or malformed) still gets its `broker_call` event, with the task when known."""
        cl = CallLog(self.clock(), source_ip, status=status, reason=reason)
        cl.task = self.registry.by_address(source_ip) if source_ip else None
        cl.extra["phase"] = "head"
        if error:
            cl.extra["error"] = error  # the parser's exception class, never its text
        self.write(cl)

    def secret_echo(self, cl: CallLog, api: str, m: ApiMetrics) -> None:
        m.scrubs.inc(cl.scrubs)
        self.events.write(secret_echo_event(cl, self.rules().version, api))

    def reload_refused(self, old: str, trigger: str, problems: list[str]) -> None:
        self.metrics.reloads.labels("failure").inc()
        self.events.write(reload_refused_event(old, trigger, problems))

    def reloaded(self, old: str, new: str, trigger: str) -> None:
        self.metrics.reloads.labels("success").inc()
        self.events.write(reloaded_event(old, new, trigger))

    def vault_status(self, state: str, cause: str) -> None:
        """A gauge and a `vault_status` event per transition."""
        self.metrics.vault_up.set(1 if state == "up" else 0)
        self.events.write(vault_status_event(state, cause))
