"""An event line in either shape it is written in (ECS, or OCSF from ocsf.py) as the ECS
fields `stockade events` reads: one accessor layer under the filters, the line format
and --summary, so every flag works the same on either file. Pure: a dict in, a dict out."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

Event = dict[str, Any]


def _obj(d: Any, key: str) -> dict[str, Any]:
    """d[key] when it is an object; a foreign or damaged line may hold anything there."""
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, dict) else {}


def _some(**kv: Any) -> dict[str, Any]:
    return {k: v for k, v in kv.items() if v is not None}


def _timestamp(ms: Any) -> str | None:
    """OCSF `time` (epoch ms) as the writer's @timestamp; None when it is not a time."""
    if not isinstance(ms, int) or isinstance(ms, bool) or ms <= 0:
        return None
    try:
        dt = datetime.fromtimestamp(ms // 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return None
    return f"{dt:%Y-%m-%dT%H:%M:%S}.{ms % 1000 * 1000:06d}Z"


def _endpoint(ep: dict[str, Any], nbytes: Any) -> dict[str, Any]:
    return _some(domain=ep.get("hostname"), ip=ep.get("ip"), port=ep.get("port"), bytes=nbytes)


def _network(ev: Event) -> dict[str, Any]:
    """source/destination, url, http, dns; a finding keeps its endpoints in evidences[0]."""
    evidences = ev.get("evidences")
    first = evidences[0] if isinstance(evidences, list) and evidences else {}
    net = ev if "dst_endpoint" in ev or "src_endpoint" in ev else first
    traffic = _obj(ev, "traffic")
    out: dict[str, Any] = {}
    for key, ocsf, nbytes in (("source", "src_endpoint", traffic.get("bytes_out")),
                              ("destination", "dst_endpoint", traffic.get("bytes_in"))):
        if part := _endpoint(_obj(net, ocsf), nbytes):
            out[key] = part
    req = _obj(ev, "http_request")
    if path := _obj(req, "url").get("path"):
        out["url"] = {"path": path}
    http = _some(request=_some(method=req.get("http_method")) or None,
                 response=_some(status_code=_obj(ev, "http_response").get("code")) or None)
    if http:
        out["http"] = http
    query = _obj(ev, "query")
    if question := _some(name=query.get("hostname"), type=query.get("type")):
        out["dns"] = {"question": question}
    return out


def _from_ocsf(ev: Event) -> Event:
    un = _obj(ev, "unmapped")
    md = _obj(ev, "metadata")
    out: Event = _some(**{"@timestamp": _timestamp(ev.get("time"))}, message=ev.get("message"))
    out["event"] = {**_obj(un, "event"), **_some(action=md.get("event_code"))}
    out["stockade"] = _obj(un, "stockade")
    for key in ("labels", "rule"):
        if key in un:
            out[key] = _obj(un, key)
    out.update(_network(ev))
    return out


def ecs_view(ev: Event) -> Event:
    """`ev` itself when it is an ECS line; an OCSF line (it has `class_uid`) mapped back to
    the ECS fields the viewer uses. `ev` is not changed."""
    return _from_ocsf(ev) if "class_uid" in ev else ev
