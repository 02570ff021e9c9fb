"""The event builder and line encoder as they were before the speed-up, kept verbatim as
an oracle: tests/core/test_events_oracle.py checks the new ones against it, and
bench/events_bench.py times it side by side with them."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

# --- the old implementation (build.py / writer.write before the speed-up) ---------------

_OLD_CATEGORY = {
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


def _old_timestamp(now: float | None = None) -> str:
    t = time.time() if now is None else now
    sec = int(t)
    head = datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{head}.{int((t - sec) * 1_000_000):06d}Z"


def _old_drop_empty(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = _old_drop_empty(v)
            if not v:
                continue
        elif v is None:
            continue
        out[k] = v
    return out


def old_make_event(
    *,
    component,
    action,
    decision=None,
    reason=None,
    task_id=None,
    profile=None,
    policy_version=None,
    rule_id=None,
    report_only=False,
    source_ip=None,
    source_port=None,
    destination_domain=None,
    destination_ip=None,
    destination_port=None,
    transport=None,
    protocol=None,
    http_method=None,
    url=None,
    http_status=None,
    dns_question=None,
    dns_response_code=None,
    message=None,
    extra=None,
    now=None,
):
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
        "schema_version": "1.0",
        "component": component,
        "decision": decision,
    }
    if report_only:
        stockade["report_only"] = True
    if extra:
        stockade.update(extra)
    ev = {
        "@timestamp": _old_timestamp(now),
        "message": message,
        "event": {
            "kind": kind,
            "category": _OLD_CATEGORY.get(action, ["network"]),
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
    return _old_drop_empty(ev)


def old_line(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")
