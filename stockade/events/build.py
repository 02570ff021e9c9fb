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
    if decision == "denied":
        types = ["denied"]
        outcome: str | None = "failure"
        kind = "alert" if action in _ALERT_ACTIONS else "event"
    elif decision == "allowed":
        types = ["allowed"]
        outcome = "success"
        kind = "event"
    else:
        types = ["info"]
        outcome = None
        kind = "alert" if action in _ALERT_ACTIONS else "event"
    if action == "connection_close":
        types = ["end", "connection"]

    ev: dict[str, Any] = {"@timestamp": timestamp(now)}
    if message is not None:
        ev["message"] = message
    e: dict[str, Any] = {
        "kind": kind,
        "category": _CATEGORY.get(action, _NETWORK),
        "type": types,
    }
    if action is not None:
        e["action"] = action
    if outcome is not None:
        e["outcome"] = outcome
    if reason is not None:
        e["reason"] = reason
    ev["event"] = e
    if source_ip is not None or source_port is not None:
        src: dict[str, Any] = {}
        if source_ip is not None:
            src["ip"] = source_ip
        if source_port is not None:
            src["port"] = source_port
        ev["source"] = src
    if destination_domain is not None or destination_ip is not None or destination_port is not None:
        dst: dict[str, Any] = {}
        if destination_domain is not None:
            dst["domain"] = destination_domain
        if destination_ip is not None:
            dst["ip"] = destination_ip
        if destination_port is not None:
            dst["port"] = destination_port
        ev["destination"] = dst
    if transport is not None or protocol is not None:
        net: dict[str, Any] = {}
        if transport is not None:
            net["transport"] = transport
        if protocol is not None:
            net["protocol"] = protocol
        ev["network"] = net
    if http_method is not None or http_status is not None:
        http: dict[str, Any] = {}
        if http_method is not None:
            http["request"] = {"method": http_method}
        if http_status is not None:
            http["response"] = {"status_code": http_status}
        ev["http"] = http
    if url is not None:
        # copied: the event must not share (or later see changes to) the caller's dict
        u = _drop_empty(url) if isinstance(url, dict) else url
        if u or not isinstance(url, dict):
            ev["url"] = u
    q = None
    if dns_question is not None:
        q = _drop_empty(dns_question) if isinstance(dns_question, dict) else dns_question
        if not q and isinstance(dns_question, dict):
            q = None
    if q is not None or dns_response_code is not None:
        dns: dict[str, Any] = {}
        if q is not None:
            dns["question"] = q
        if dns_response_code is not None:
            dns["response_code"] = dns_response_code
        ev["dns"] = dns
    if rule_id is not None or policy_version is not None:
        rule: dict[str, Any] = {}
        if rule_id is not None:
            rule["id"] = rule_id
        if policy_version is not None:
            rule["ruleset"] = policy_version
        ev["rule"] = rule
    if task_id is not None or profile is not None:
        labels: dict[str, Any] = {}
        if task_id is not None:
            labels["task_id"] = task_id
        if profile is not None:
            labels["profile"] = profile
        ev["labels"] = labels
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
    if st:  # only empty when extra set every key to None
        ev["stockade"] = st
    return ev
