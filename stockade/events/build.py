"""One event shape for every component (gateway, DNS, broker, launcher).

Events are plain dicts with ECS field names, built here and nowhere else, so the SOC
gets one schema (`schema.json`, versioned by SCHEMA_VERSION).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Literal

SCHEMA_VERSION = "1.0"

Component = Literal["gateway", "dns", "broker", "launcher", "rules", "stack"]
Decision = Literal["allowed", "denied"]

# event.category per action, from ECS's allowed values
_CATEGORY = {
    "connection_decision": ["network"],
    "connection_close": ["network"],
    "request_decision": ["network"],  # one request inside an inspected (L7) TLS flow
    "dns_decision": ["network"],
    "broker_call": ["network", "iam"],
    "secret_echo": ["network", "iam"],
    "bypass_attempt": ["network", "intrusion_detection"],
    "sandbox_lifecycle": ["process"],
    "export_decision": ["file"],
    "rules_reload": ["configuration"],
    "vault_status": ["iam"],
    "component_restarted": ["process"],  # `stockade up` restarted a component that died
}


_second_cache: tuple[int, str] = (-1, "")


def timestamp(now: float | None = None) -> str:
    """RFC 3339 UTC with microseconds; the seconds part is formatted once per second
    (events are on the gateway's per-connection path)."""
    global _second_cache
    t = time.time() if now is None else now
    sec = int(t)
    if _second_cache[0] != sec:
        _second_cache = (sec, datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{_second_cache[1]}.{int((t - sec) * 1_000_000):06d}Z"


def _drop_empty(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of `d` without None values and without dicts that end up empty, recursively.
    Only caller-supplied dicts (url, dns_question, extra) need it: make_event builds its
    own parts without None in the first place."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = _drop_empty(v)
            if not v:
                continue
        elif v is None:
            continue
        out[k] = v
    return out


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    """`_drop_empty(d)`, but `d` itself when there is nothing to drop (the usual case:
    a flat dict of set values), so it costs one scan instead of a copy per level."""
    for v in d.values():
        if v is None or isinstance(v, dict):
            return _drop_empty(d)
    return d


_ALERT_ACTIONS = frozenset(("bypass_attempt", "secret_echo"))
_NETWORK = ["network"]


def make_event(
    *,
    component: Component,
    action: str,
    decision: Decision | None = None,
    reason: str | None = None,
    task_id: str | None = None,
    profile: str | None = None,
    policy_version: str | None = None,
    rule_id: str | None = None,
    report_only: bool = False,
    source_ip: str | None = None,
    source_port: int | None = None,
    destination_domain: str | None = None,
    destination_ip: str | None = None,
    destination_port: int | None = None,
    transport: str | None = None,
    protocol: str | None = None,
    http_method: str | None = None,
    url: dict[str, Any] | None = None,
    http_status: int | None = None,
    dns_question: dict[str, Any] | None = None,
    dns_response_code: str | None = None,
    message: str | None = None,
    extra: dict[str, Any] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """Build one event. `extra` lands under `stockade.*` (bytes, durations, api, ...).

    None values and empty objects are left out. The parts are built without them
    directly (no cleanup pass over the whole event: this runs per connection and per
    broker call); keys keep the schema's order, so the written line is the same as when
    every field was set to None and then dropped.
    """
    ev: dict[str, Any] = {"@timestamp": timestamp(now)}
    if message is not None:
        ev["message"] = message
    ev["event"] = _event_part(action, decision, reason)
    # the field table: one ECS object per line, its keys in the schema's order
    _put(ev, "source", "ip", source_ip, "port", source_port)
    _put(ev, "destination", "domain", destination_domain, "ip", destination_ip,
         "port", destination_port)
    _put(ev, "network", "transport", transport, "protocol", protocol)
    _put(ev, "http", "request", None if http_method is None else {"method": http_method},
         "response", None if http_status is None else {"status_code": http_status})
    u = _caller_part(url)
    if u is not None:
        ev["url"] = u
    _put(ev, "dns", "question", _caller_part(dns_question), "response_code", dns_response_code)
    _put(ev, "rule", "id", rule_id, "ruleset", policy_version)
    _put(ev, "labels", "task_id", task_id, "profile", profile)
    st = _stockade_part(component, decision, report_only, extra)
    if st:  # only empty when extra set every key to None
        ev["stockade"] = st
    return ev


def _event_part(action: str, decision: Decision | None, reason: str | None) -> dict[str, Any]:
    """The ECS `event` object; its type list is fresh per event."""
    if decision == "denied":
        types, outcome = ["denied"], "failure"
    elif decision == "allowed":
        types, outcome = ["allowed"], "success"
    else:
        types, outcome = ["info"], None
    # an allowed bypass attempt or secret echo is not an alert; a denied or undecided one is
    kind = "alert" if decision != "allowed" and action in _ALERT_ACTIONS else "event"
    if action == "connection_close":
        types = ["end", "connection"]
    e: dict[str, Any] = {"kind": kind, "category": _CATEGORY.get(action, _NETWORK), "type": types}
    if action is not None:
        e["action"] = action
    if outcome is not None:
        e["outcome"] = outcome
    if reason is not None:
        e["reason"] = reason
    return e


def _put(
    ev: dict[str, Any], key: str, k1: str, v1: Any, k2: str, v2: Any, k3: str = "", v3: Any = None
) -> None:
    """`ev[key]` = the fields among (k1, v1), (k2, v2), (k3, v3) that are set, in that
    order; left out when none is. Fixed arity and plain tests, no loop: a comprehension
    over the pairs made every event twice as expensive to build."""
    if v1 is None and v2 is None and v3 is None:
        return
    part: dict[str, Any] = {}
    if v1 is not None:
        part[k1] = v1
    if v2 is not None:
        part[k2] = v2
    if v3 is not None:
        part[k3] = v3
    ev[key] = part


def _caller_part(value: Any) -> Any:
    """A caller-supplied object (url, dns question) without its empty parts, or None
    when nothing is left. Copied: the event must not share (or later see changes to)
    the caller's dict."""
    if not isinstance(value, dict):
        return value
    cleaned = _drop_empty(value)
    return cleaned if cleaned else None


def _stockade_part(
    component: Component, decision: Decision | None, report_only: bool, extra: dict[str, Any] | None
) -> dict[str, Any]:
    # `extra` may override these keys (in place, keeping their position) or hold None
    # and nested dicts, so this part is built as before and cleaned when it needs it
    st: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "component": component}
    if decision is not None or (extra and "decision" in extra):
        st["decision"] = decision
    if report_only:
        st["report_only"] = True
    if extra:
        st.update(extra)
        st = _clean(st)
    elif component is None:
        del st["component"]
    return st
