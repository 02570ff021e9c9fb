"""One event shape for every component (gateway, DNS, broker, launcher).

Events are plain dicts with ECS field names, built here and nowhere else, so the SOC
gets one schema (`schema.json`, versioned by SCHEMA_VERSION).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Literal

SCHEMA_VERSION = "1.0"

Component = Literal["gateway", "dns", "broker", "launcher", "rules"]
Decision = Literal["allowed", "denied"]

# event.category per action, from ECS's allowed values
_CATEGORY = {
    "connection_decision": ["network"],
    "connection_close": ["network"],
    "dns_decision": ["network"],
    "broker_call": ["network", "iam"],
    "secret_echo": ["network", "iam"],
    "bypass_attempt": ["network", "intrusion_detection"],
    "sandbox_lifecycle": ["process"],
    "export_decision": ["file"],
    "rules_reload": ["configuration"],
    "vault_status": ["iam"],
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
    """Build one event. `extra` lands under `stockade.*` (bytes, durations, api, ...)."""
    if decision == "denied":
        types = ["denied"]
        outcome = "failure"
        kind = "alert" if action in ("bypass_attempt", "secret_echo") else "event"
    elif decision == "allowed":
        types = ["allowed"]
        outcome = "success"
        kind = "event"
    else:
        types = ["info"]
        outcome = None
        kind = "alert" if action in ("bypass_attempt", "secret_echo") else "event"
    if action == "connection_close":
        types = ["end", "connection"]
    stockade: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "component": component,
        "decision": decision,
    }
    if report_only:
        stockade["report_only"] = True
    if extra:
        stockade.update(extra)
    ev = {
        "@timestamp": timestamp(now),
        "message": message,
        "event": {
            "kind": kind,
            "category": _CATEGORY.get(action, ["network"]),
            "type": types,
            "action": action,
            "outcome": outcome,
            "reason": reason,
        },
        "source": {"ip": source_ip, "port": source_port},
        "destination": {
            "domain": destination_domain,
            "ip": destination_ip,
            "port": destination_port,
        },
        "network": {"transport": transport, "protocol": protocol},
        "http": {
            "request": {"method": http_method},
            "response": {"status_code": http_status},
        },
        "url": url,
        "dns": {"question": dns_question, "response_code": dns_response_code},
        "rule": {"id": rule_id, "ruleset": policy_version},
        "labels": {"task_id": task_id, "profile": profile},
        "stockade": stockade,
    }
    return _drop_empty(ev)
