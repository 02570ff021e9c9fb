"""One event shape for every component (gateway, DNS, broker, launcher).

Events are plain dicts with ECS field names, built here and nowhere else, so the SOC
gets one schema (`schema.json`, versioned by SCHEMA_VERSION).
"""

from __future__ import annotations

import socket
import time
from datetime import UTC, datetime
from typing import Any, Literal

from stockade import __version__

SCHEMA_VERSION = "2.0"
ECS_VERSION = "9.4.0"  # every event's ecs.version; schema.json's x-es-type are this release's

Component = Literal["gateway", "dns", "broker", "launcher", "rules", "stack"]
Decision = Literal["allowed", "denied"]

_T = tuple[str, ...]
# action -> (event.category, event.type when allowed, when denied, when undecided). Every
# type is among ECS's expected types of every category listed (checked in the tests).
_CATEGORY: dict[str, tuple[list[str], _T, _T, _T]] = {
    "connection_decision": (["network"], ("connection", "allowed"), ("connection", "denied"),
                            ("info",)),
    "connection_close": (["network"], ("end", "connection"), ("end", "connection"),
                         ("end", "connection")),
    # one request inside an inspected (L7) TLS flow, one DNS query
    "request_decision": (["network"], ("protocol", "allowed"), ("protocol", "denied"),
                         ("protocol",)),
    "dns_decision": (["network"], ("protocol", "allowed"), ("protocol", "denied"), ("protocol",)),
    "broker_call": (["api", "network"], ("access", "allowed"), ("access", "denied"), ("info",)),
    "secret_echo": (["api", "intrusion_detection"], ("info",), ("info",), ("info",)),
    "bypass_attempt": (["network", "intrusion_detection"], ("allowed",), ("denied",), ("info",)),
    "sandbox_lifecycle": (["process"], ("change",), ("change",), ("change",)),  # see _types
    # the decision is the outcome: file/configuration allow no allowed/denied type
    "export_decision": (["file"], ("creation",), ("creation",), ("creation",)),
    "rules_reload": (["configuration"], ("change",), ("change",), ("change",)),
    "vault_status": (["api"], ("info",), ("info",), ("info",)),
    "component_restarted": (["process"], ("start",), ("start",), ("start",)),  # `stockade up`
    # the writer's own records about the log
    "event_totals": (["file"], ("info",), ("info",), ("info",)),
    "events_lost": (["file"], ("info",), ("info",), ("info",)),
    "chain_checkpoint": (["file"], ("info",), ("info",), ("info",)),
}
_DEFAULT = (["network"], ("allowed",), ("denied",), ("info",))
_LIFECYCLE_TYPE = {"start": "start", "end": "end"}  # kill/suspend/resume: a change
_SUMMARY = "event_summary"

# Stockade's own names for what ECS has a field for: moved out of `extra` (`stockade.*`)
# into (ECS object, field, conversion or None). An entry of None: the key is dropped, it
# repeats another field. `export` is split by _move_export.
_STANDARD: dict[str, tuple[str, str, Any] | None] = {
    "bytes_up": ("source", "bytes", None),
    "bytes_down": ("destination", "bytes", None),
    "duration_s": ("event", "duration", lambda s: round(s * 1e9)),  # ECS: nanoseconds
    "latency_ms": ("event", "duration", lambda ms: round(ms * 1e6)),
    "exit_code": ("process", "exit_code", None),
    "status": None,  # the broker's copy of http.response.status_code
    "http_version": ("http", "version", None),
    "error": ("error", "type", None),  # an exception class name, never its text
}
_STANDARD_KEYS = frozenset((*_STANDARD, "export"))

_OBSERVER_TYPE = {"gateway": "firewall", "dns": "firewall", "broker": "proxy",
                  "launcher": "sandbox", "rules": "manager", "stack": "manager"}


def _observer(kind: str) -> dict[str, str]:
    return {"vendor": "Stockade", "product": "Stockade", "version": __version__,
            "hostname": _HOSTNAME, "type": kind}


_HOSTNAME = socket.gethostname()  # once: the host does not change under a running process
# one `observer` object per component, shared by its events: nobody mutates it
_OBSERVERS = {c: _observer(t) for c, t in _OBSERVER_TYPE.items()}
_OBSERVER_OTHER = _observer("manager")
_DATASETS = {c: f"stockade.{c}" for c in _OBSERVER_TYPE}
_ECS = {"version": ECS_VERSION}  # shared by every event, like the observers


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
    """Build one event. `extra` lands under `stockade.*` (api, listener, ...), except the
    keys ECS has a field for (`_STANDARD`: bytes, durations, exit code, ...).

    None values and empty objects are left out. The parts are built without them
    directly (no cleanup pass over the whole event: this runs per connection and per
    broker call); keys keep the schema's order, then the moved ECS fields, then `stockade`.
    """
    ev: dict[str, Any] = {"@timestamp": timestamp(now), "ecs": _ECS}
    if message is not None:
        ev["message"] = message
    ev["event"] = _event_part(component, action, decision, reason, extra)
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
    ev["observer"] = _OBSERVERS.get(component, _OBSERVER_OTHER)  # type: ignore[arg-type]
    st = _stockade_part(component, decision, report_only, extra)
    if extra and not _STANDARD_KEYS.isdisjoint(st):
        _move_standard(ev, st, http_status)
    if st:  # only empty when extra set every key to None
        ev["stockade"] = st
    return ev


def _event_part(component: str, action: str, decision: Decision | None, reason: str | None,
                extra: dict[str, Any] | None) -> dict[str, Any]:
    """The ECS `event` object; its category and type lists are fresh per event."""
    categories, types = _types(action, decision, extra)
    if action == "vault_status":  # no decision: the outcome is whether Vault answers
        outcome: str | None = "success" if reason == "vault_up" else "failure"
    else:
        outcome = _OUTCOME.get(decision)  # type: ignore[arg-type]
    # an allowed bypass attempt or secret echo is not an alert; a denied or undecided one is
    kind = "alert" if decision != "allowed" and action in _ALERT_ACTIONS else "event"
    e: dict[str, Any] = {"kind": kind, "category": categories, "type": types}
    if action is not None:
        e["action"] = action
    e["dataset"] = _DATASETS.get(component) or f"stockade.{component}"
    e["module"] = "stockade"
    if outcome is not None:
        e["outcome"] = outcome
    if reason is not None:
        e["reason"] = reason
    return e


_OUTCOME = {"allowed": "success", "denied": "failure"}
_BY_DECISION = {"allowed": 1, "denied": 2}


def _types(action: str, decision: Decision | None,
           extra: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(event.category, event.type) of one event. A summary takes those of the action it
    summarises; a lifecycle event's type is its `lifecycle` (start, end, else a change)."""
    if action == _SUMMARY and extra and isinstance(extra.get("summary"), dict):
        action = extra["summary"].get("action")
    row = _CATEGORY.get(action, _DEFAULT)
    if action == "sandbox_lifecycle" and extra:
        return list(row[0]), [_LIFECYCLE_TYPE.get(str(extra.get("lifecycle")), "change")]
    return list(row[0]), list(row[_BY_DECISION.get(decision, 3)])  # type: ignore[misc]


def _move_standard(ev: dict[str, Any], st: dict[str, Any], http_status: int | None) -> None:
    """Move the `_STANDARD` keys of the stockade part `st` into their ECS fields, in
    place. A value of the wrong type stays where it was: schema.json then reports it
    (nothing is lost, nothing is coerced)."""
    for key in [k for k in st if k in _STANDARD_KEYS]:
        v = st[key]
        if key == "export":
            _move_export(ev, st, v)
        elif key == "status":
            if v == http_status:
                del st[key]
        elif _fits(key, v):
            obj, name, convert = _STANDARD[key]  # type: ignore[misc]
            ev.setdefault(obj, {})[name] = v if convert is None else convert(v)
            del st[key]
    src, dst = ev.get("source", {}).get("bytes"), ev.get("destination", {}).get("bytes")
    if src is not None and dst is not None:
        ev.setdefault("network", {})["bytes"] = src + dst


def _fits(key: str, v: Any) -> bool:
    """Whether `v` has the type of `key`'s ECS field (long, or str for the keywords)."""
    if key in ("http_version", "error"):
        return isinstance(v, str)
    if key in ("duration_s", "latency_ms"):  # seconds or ms, to a long of nanoseconds
        return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < _LONG / 1e9
    if key == "exit_code":  # negative: killed by that signal
        return isinstance(v, int) and not isinstance(v, bool) and -_LONG <= v < _LONG
    return _is_count(v)


_LONG = 2**63  # an ECS long is signed 64-bit


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _LONG


def _move_export(ev: dict[str, Any], st: dict[str, Any], export: Any) -> None:
    """`export.name`/`size` are ECS `file.name`/`file.size`; `type` and `why` stay."""
    if not isinstance(export, dict):
        return
    name, size = export.get("name"), export.get("size")
    f: dict[str, Any] = {}
    if isinstance(name, str):
        f["name"] = name
    if _is_count(size):
        f["size"] = size
    if f:
        ev["file"] = f
        rest = {k: v for k, v in export.items() if k not in f}
        if rest:
            st["export"] = rest
        else:
            del st["export"]


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
