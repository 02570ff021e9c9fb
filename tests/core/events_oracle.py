"""The event builder and line encoder as they were before the speed-up, kept verbatim as
an oracle: tests/core/test_events_oracle.py checks the new ones against it, and
bench/events_bench.py times it side by side with them."""

from __future__ import annotations

import json
import socket
import time
from datetime import UTC, datetime
from typing import Any

from stockade import __version__

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


# --- schema 2.0 (ECS conformance): what changed, written out from docs/events.md -------
# action: (categories, type if allowed, if denied, if undecided); "+" joins two types
_V2_TYPES = {
    "connection_decision": ("network", "connection+allowed", "connection+denied", "info"),
    "connection_close": ("network", "end+connection", "end+connection", "end+connection"),
    "request_decision": ("network", "protocol+allowed", "protocol+denied", "protocol"),
    "dns_decision": ("network", "protocol+allowed", "protocol+denied", "protocol"),
    "broker_call": ("api+network", "access+allowed", "access+denied", "info"),
    "secret_echo": ("api+intrusion_detection", "info", "info", "info"),
    "bypass_attempt": ("network+intrusion_detection", "allowed", "denied", "info"),
    "sandbox_lifecycle": ("process", "", "", ""),
    "export_decision": ("file", "creation", "creation", "creation"),
    "rules_reload": ("configuration", "change", "change", "change"),
    "vault_status": ("api", "info", "info", "info"),
    "component_restarted": ("process", "start", "start", "start"),
    "event_totals": ("file", "info", "info", "info"),
    "events_lost": ("file", "info", "info", "info"),
    "chain_checkpoint": ("file", "info", "info", "info"),
}
_OBSERVER_TYPES = {"gateway": "firewall", "dns": "firewall", "broker": "proxy",
                   "launcher": "sandbox"}


def _v2_category_type(kw: dict[str, Any]) -> tuple[list[str], list[str]]:
    action, extra = kw["action"], kw.get("extra") or {}
    summary = extra.get("summary")
    if action == "event_summary" and isinstance(summary, dict):
        action = summary.get("action")
    cats, *by = _V2_TYPES.get(action, ("network", "allowed", "denied", "info"))
    pick = by[{"allowed": 0, "denied": 1}.get(kw.get("decision"), 2)]
    if action == "sandbox_lifecycle":
        life = extra.get("lifecycle")
        pick = life if life in ("start", "end") else "change"
    return cats.split("+"), pick.split("+")


def _is_long(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**63


def _v2_moved(st: dict[str, Any], http_status: Any) -> list[tuple[str, str, Any]]:
    """The (object, field, value) moved out of `stockade` per the documented table, and
    `st` without them (in place)."""
    moves: list[tuple[str, str, Any]] = []
    for key in list(st):
        v = st[key]
        number = type(v) in (int, float) and 0 <= v < 2**63 / 1e9
        if key == "bytes_up" and _is_long(v):
            moves.append(("source", "bytes", v))
        elif key == "bytes_down" and _is_long(v):
            moves.append(("destination", "bytes", v))
        elif key == "duration_s" and number:
            moves.append(("event", "duration", round(v * 1_000_000_000)))
        elif key == "latency_ms" and number:
            moves.append(("event", "duration", round(v * 1_000_000)))
        elif key == "exit_code" and type(v) is int and -(2**63) <= v < 2**63:
            moves.append(("process", "exit_code", v))
        elif key in ("http_version", "error") and type(v) is str:
            moves.append(("http", "version", v) if key == "http_version" else ("error", "type", v))
        elif key == "status" and v == http_status:
            pass
        elif key == "export" and isinstance(v, dict):
            f = {"name": v["name"]} if type(v.get("name")) is str else {}
            if _is_long(v.get("size")):
                f["size"] = v["size"]
            moves += [("file", k, x) for k, x in f.items()]
            rest = {k: x for k, x in v.items() if k not in f}
            if rest or not f:
                st[key] = rest if f else v
                continue
        else:
            continue
        del st[key]
    return moves


def upgrade_v2(old: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    """`old` (old_make_event(**kw)) as schema 2.0 has it: ecs.version, event.dataset and
    module, observer, the ECS category/type table, and the moves out of `stockade`."""
    component = kw["component"]
    head: dict[str, Any] = {"@timestamp": old["@timestamp"], "ecs": {"version": "9.4.0"}}
    if "message" in old:
        head["message"] = old["message"]
    e = dict(old["event"])
    e["category"], e["type"] = _v2_category_type(kw)
    tail = {k: e.pop(k) for k in ("outcome", "reason") if k in e}
    e.update({"dataset": f"stockade.{component}", "module": "stockade"})
    if kw["action"] == "vault_status":
        tail["outcome"] = "success" if kw.get("reason") == "vault_up" else "failure"
        tail = {k: tail[k] for k in ("outcome", "reason") if k in tail}
    head["event"] = {**e, **tail}
    new = {**head, **{k: v for k, v in old.items() if k not in (*head, "stockade")}}
    new["observer"] = {"vendor": "Stockade", "product": "Stockade", "version": __version__,
                       "hostname": socket.gethostname(),
                       "type": _OBSERVER_TYPES.get(component, "manager")}
    st = dict(old.get("stockade", {}))
    if "schema_version" not in (kw.get("extra") or {}) and "schema_version" in st:
        st["schema_version"] = "2.0"
    for obj, field, value in _v2_moved(st, kw.get("http_status")):
        new.setdefault(obj, {})[field] = value
    up, down = new.get("source", {}).get("bytes"), new.get("destination", {}).get("bytes")
    if up is not None and down is not None:
        new.setdefault("network", {})["bytes"] = up + down
    if st:
        new["stockade"] = st
    return new
