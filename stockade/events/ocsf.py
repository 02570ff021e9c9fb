"""One Stockade event (ECS shape, build.py) as an OCSF 1.5.0 event, for SIEMs that take
OCSF (`events.format: ocsf`; docs/events.md "OCSF"). Pure: a dict in, a new dict out.

Each action has one OCSF class and its activity (the table in docs/events.md). What OCSF
has no attribute for stays under `unmapped`: the rest of `stockade.*` as `unmapped.stockade`,
the chain link as `unmapped.chain`, the labels as `unmapped.labels`, so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from .writer import encode_line

OCSF_VERSION = "1.5.0"
Event = dict[str, Any]

# class_uid -> (class_name, category_uid, category_name)
_CLASSES: dict[int, tuple[str, int, str]] = {
    1001: ("File System Activity", 1, "System Activity"),
    1007: ("Process Activity", 1, "System Activity"),
    1008: ("Event Log Activity", 1, "System Activity"),
    2004: ("Detection Finding", 2, "Findings"),
    4001: ("Network Activity", 4, "Network Activity"),
    4002: ("HTTP Activity", 4, "Network Activity"),
    4003: ("DNS Activity", 4, "Network Activity"),
    6002: ("Application Lifecycle", 6, "Application Activity"),
    6003: ("API Activity", 6, "Application Activity"),
}
_ACTIVITY_NAMES: dict[int, dict[int, str]] = {
    1001: {1: "Create"}, 1007: {1: "Launch", 2: "Terminate", 99: "Other"},
    1008: {99: "Other"}, 2004: {1: "Create"},
    4001: {1: "Open", 2: "Close", 3: "Reset", 5: "Refuse"},
    4002: {1: "Connect", 2: "Delete", 3: "Get", 4: "Head", 5: "Options", 6: "Post",
           7: "Put", 8: "Trace", 99: "Other"},
    4003: {1: "Query"}, 6002: {5: "Restart", 8: "Update", 99: "Other"},
    6003: {1: "Create", 2: "Read", 3: "Update", 4: "Delete", 99: "Other"},
}
_CLASS_OF = {
    "connection_decision": 4001, "connection_close": 4001, "request_decision": 4002,
    "dns_decision": 4003, "broker_call": 6003, "secret_echo": 2004, "bypass_attempt": 2004,
    "sandbox_lifecycle": 1007, "export_decision": 1001, "rules_reload": 6002,
    "vault_status": 6002, "component_restarted": 6002,
}  # every other action (the writer's own records about the log): 1008 Event Log Activity
_HTTP_ACTIVITY = {"CONNECT": 1, "DELETE": 2, "GET": 3, "HEAD": 4, "OPTIONS": 5, "POST": 6,
                  "PUT": 7, "TRACE": 8}
_API_ACTIVITY = {"POST": 1, "GET": 2, "HEAD": 2, "PUT": 3, "PATCH": 3, "DELETE": 4}
_RCODE = {"NOERROR": 0, "FORMERR": 1, "SERVFAIL": 2, "NXDOMAIN": 3, "NOTIMP": 4, "REFUSED": 5}
_RESET_REASONS = frozenset(("upload_limit", "task_ended"))
_FIXED_ACTIVITY = {"dns_decision": 1, "secret_echo": 1, "bypass_attempt": 1,
                   "export_decision": 1, "rules_reload": 8, "vault_status": 99,
                   "component_restarted": 5}
_SEVERITY = {"secret_echo": 4, "bypass_attempt": 3}  # alerts; the rest: 1 Informational
# security_control profile: decision -> (action_id, disposition_id)
_DISPOSITION = {"allowed": (1, 1), "denied": (2, 2)}
_ACTOR = {"broker": "stockade-broker", "launcher": "stockade-launcher"}


def _get(ev: Event, obj: str, key: str) -> Any:
    part = ev.get(obj)
    return part.get(key) if isinstance(part, dict) else None


def _text(v: Any) -> str:
    """`v` when it is a string, else "": a malformed field never breaks the mapping."""
    return v if isinstance(v, str) else ""


def _method(ev: Event) -> str:
    req = _get(ev, "http", "request")
    m = req.get("method") if isinstance(req, dict) else None
    return m.upper() if isinstance(m, str) else ""


def _activity(action: str, ev: Event, st: dict[str, Any]) -> int:
    """The activity_id of the action's OCSF class (the table in docs/events.md)."""
    if action in _FIXED_ACTIVITY:
        return _FIXED_ACTIVITY[action]
    if action == "connection_decision":
        return 5 if st.get("decision") == "denied" else 1
    if action == "connection_close":
        return 3 if _text(_get(ev, "event", "reason")) in _RESET_REASONS else 2
    if action == "request_decision":
        return _HTTP_ACTIVITY.get(_method(ev), 99)
    if action == "broker_call":
        return _API_ACTIVITY.get(_method(ev), 99)
    if action == "sandbox_lifecycle":
        return {"start": 1, "end": 2}.get(_text(st.get("lifecycle")), 99)
    return 99


def _time_ms(ts: Any) -> int:
    """@timestamp (RFC 3339) as epoch milliseconds; 0 when it is missing or unreadable."""
    try:
        t = datetime.fromisoformat(ts) if isinstance(ts, str) else None
    except ValueError:
        return 0
    # whole seconds and microseconds apart: a float of the whole time would round 123 ms
    # down to 122 now and then
    return int(t.timestamp()) * 1000 + t.microsecond // 1000 if t is not None else 0


def _endpoint(part: Any) -> dict[str, Any] | None:
    if not isinstance(part, dict):
        return None
    out = {k: part[k] for k in ("ip", "port") if k in part}
    if "domain" in part:
        out["hostname"] = part["domain"]
    return out or None


def _network(ev: Event) -> dict[str, Any]:
    """Endpoints, connection and traffic: the attributes every network-ish class shares."""
    out: dict[str, Any] = {}
    for key, obj in (("src_endpoint", "source"), ("dst_endpoint", "destination")):
        if (e := _endpoint(ev.get(obj))) is not None:
            out[key] = e
    conn: dict[str, Any] = {"direction_id": 2}  # Outbound: sandboxes only dial out
    if (t := _get(ev, "network", "transport")) is not None:
        conn["protocol_name"] = t
    out["connection_info"] = conn
    traffic = {k: v for k, v in (("bytes_out", _get(ev, "source", "bytes")),
                                 ("bytes_in", _get(ev, "destination", "bytes"))) if v is not None}
    if traffic:
        out["traffic"] = traffic
    return out


def _http(ev: Event) -> dict[str, Any]:
    out: dict[str, Any] = {}
    req: dict[str, Any] = {}
    if m := _method(ev):
        req["http_method"] = m
    u = ev.get("url")
    if isinstance(u, dict):
        url = {k: u[k] for k in ("scheme", "path", "port") if k in u}
        url.update({o: u[k] for k, o in (("full", "url_string"), ("domain", "hostname"),
                                         ("query", "query_string")) if k in u})
        req["url"] = url
    if (v := _get(ev, "http", "version")) is not None:
        req["version"] = v
    if req:
        out["http_request"] = req
    resp = _get(ev, "http", "response")
    if isinstance(resp, dict) and "status_code" in resp:
        out["http_response"] = {"code": resp["status_code"]}
    return out


def _dns(ev: Event) -> dict[str, Any]:
    q = _get(ev, "dns", "question")
    out: dict[str, Any] = {}
    if isinstance(q, dict):
        out["query"] = {o: q[k] for k, o in (("name", "hostname"), ("type", "type")) if k in q}
    rc = _get(ev, "dns", "response_code")
    if isinstance(rc, str):
        out["rcode"] = rc
        out["rcode_id"] = _RCODE.get(rc.upper(), 99)
    return out


def _actor(st: dict[str, Any]) -> dict[str, Any]:
    comp = _text(st.get("component"))
    return {"app_name": _ACTOR.get(comp, f"stockade-{comp}")}


def _actor_device(ev: Event, st: dict[str, Any]) -> dict[str, Any]:
    # the device is the appliance itself (type_id 1 Server), named as in observer.hostname
    return {"actor": _actor(st),
            "device": {"type_id": 1, "hostname": _text(_get(ev, "observer", "hostname"))}}


def _action(ev: Event) -> str:
    return _text(_get(ev, "event", "action"))


def _network_class(ev: Event, st: dict[str, Any], uid: str) -> dict[str, Any]:
    return _network(ev)


def _http_class(ev: Event, st: dict[str, Any], uid: str) -> dict[str, Any]:
    return {**_network(ev), **_http(ev)}


def _dns_class(ev: Event, st: dict[str, Any], uid: str) -> dict[str, Any]:
    return {**_network(ev), **_dns(ev)}


def _api_class(ev: Event, st: dict[str, Any], uid: str) -> dict[str, Any]:
    api: dict[str, Any] = {"operation": _method(ev) or "call"}
    if isinstance(st.get("api"), str):
        api["service"] = {"name": st["api"]}
    net = _network(ev)
    out = {"actor": _actor(st), "api": api, **_http(ev),
           "src_endpoint": net.get("src_endpoint", {})}  # required by the class
    if "dst_endpoint" in net:
        out["dst_endpoint"] = net["dst_endpoint"]
    return out


def _finding_class(ev: Event, st: dict[str, Any], uid: str) -> dict[str, Any]:
    out: dict[str, Any] = {"finding_info": {"uid": uid, "title": _action(ev)}}
    if (net := _network(ev)).keys() - {"connection_info"}:  # what was tried, and where
        out["evidences"] = [{k: v for k, v in net.items() if k != "traffic"}]
    return out


def _process_class(ev: Event, st: dict[str, Any], uid: str) -> dict[str, Any]:
    # the sandbox is named by its task: the launcher runs one per task
    proc = {"name": _text(_get(ev, "labels", "task_id")) or "sandbox"}
    return {**_actor_device(ev, st), "process": proc}


def _file_class(ev: Event, st: dict[str, Any], uid: str) -> dict[str, Any]:
    f = {"type_id": 1, "name": _text(_get(ev, "file", "name"))}  # 1: Regular File
    if (size := _get(ev, "file", "size")) is not None:
        f["size"] = size
    return {**_actor_device(ev, st), "file": f}


def _app_class(ev: Event, st: dict[str, Any], uid: str) -> dict[str, Any]:
    return {"app": {"name": "Stockade", "vendor_name": "Stockade",
                    "version": _text(_get(ev, "observer", "version"))}}


# class_uid -> the class's own attributes (and those it requires); 1008 has none
_PER_CLASS: dict[int, Callable[[Event, dict[str, Any], str], dict[str, Any]]] = {
    4001: _network_class, 4002: _http_class, 4003: _dns_class, 6003: _api_class,
    2004: _finding_class, 1007: _process_class, 1001: _file_class, 6002: _app_class,
}


def _metadata(ev: Event, action: str) -> dict[str, Any]:
    md: dict[str, Any] = {
        "version": OCSF_VERSION, "profiles": ["security_control"], "event_code": action,
        "product": {"name": "Stockade", "vendor_name": "Stockade",
                    "version": _text(_get(ev, "observer", "version"))}}
    if (uid := _get(ev, "event", "id")) is not None:
        md["uid"] = uid
    if (seq := _get(ev, "event", "sequence")) is not None:
        md["sequence"] = seq
    return md


def _unmapped(ev: Event, st: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rest = {k: v for k, v in st.items() if k != "chain"}
    if rest:
        out["stockade"] = rest
    if isinstance(st.get("chain"), dict):
        out["chain"] = st["chain"]
    if isinstance(ev.get("labels"), dict):
        out["labels"] = ev["labels"]
    # no OCSF attribute says why or whether it is an alert: the viewer filters on both
    ecs_event = {k: v for k in ("reason", "kind") if (v := _get(ev, "event", k)) is not None}
    if ecs_event:
        out["event"] = ecs_event
    # no attribute of these classes holds them; host is what a shipper adds (host.name)
    for obj in ("error", "rule", "process", "host"):
        if isinstance(ev.get(obj), dict):
            out[obj] = ev[obj]
    return out


def _result(ev: Event, st: dict[str, Any], summary: Any) -> dict[str, Any]:
    """Message, status, disposition, duration and a summary's count and time range."""
    out: dict[str, Any] = {}
    if (msg := ev.get("message")) is not None:
        out["message"] = msg
    outcome = _get(ev, "event", "outcome")
    if outcome in ("success", "failure"):
        out["status_id"] = 1 if outcome == "success" else 2
    if (disp := _DISPOSITION.get(_text(st.get("decision")))) is not None:
        out["action_id"], out["disposition_id"] = disp
    d = _get(ev, "event", "duration")
    if isinstance(d, int) and not isinstance(d, bool):  # ECS ns -> OCSF ms, cut like VRL's
        out["duration"] = d // 1_000_000
    if isinstance(summary, dict):
        out.update(count=summary.get("count"), start_time=_time_ms(summary.get("first")),
                   end_time=_time_ms(summary.get("last")))
    return out


def to_ocsf(ev: Event) -> Event:
    """`ev` (a Stockade event) as an OCSF 1.5.0 event; `ev` is not changed."""
    st: dict[str, Any] = ev["stockade"] if isinstance(ev.get("stockade"), dict) else {}
    action = _action(ev)
    summary = st.get("summary") if action == "event_summary" else None
    # a summary stands for events of its action: it takes that action's class
    as_action = summary.get("action") if isinstance(summary, dict) else None
    mapped = as_action if isinstance(as_action, str) else action
    cls = _CLASS_OF.get(mapped, 1008)
    act = _activity(mapped, ev, st) if cls != 1008 else 99
    name, cat, cat_name = _CLASSES[cls]
    act_name = _ACTIVITY_NAMES[cls].get(act, "Other")
    out: Event = {
        "class_uid": cls, "class_name": name, "category_uid": cat, "category_name": cat_name,
        "activity_id": act, "activity_name": act_name, "type_uid": cls * 100 + act,
        "type_name": f"{name}: {act_name}", "time": _time_ms(ev.get("@timestamp")),
        "severity_id": _SEVERITY.get(mapped, 1), "metadata": _metadata(ev, action)}
    out.update(_result(ev, st, summary))
    if (per_class := _PER_CLASS.get(cls)) is not None:
        out.update(per_class(ev, st, _text(_get(ev, "event", "id")) or action))
    if unmapped := _unmapped(ev, st):
        out["unmapped"] = unmapped
    return out


def encode_ocsf(ev: Event) -> bytes:
    """The writer's encoder for `events.format: ocsf`: the OCSF event as one JSON line."""
    return encode_line(to_ocsf(ev))
