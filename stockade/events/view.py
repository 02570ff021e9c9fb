"""Pure helpers for `stockade events`: parse --since, filter events, format one line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(text: str) -> float:
    """'90', '90s', '5m', '2h', '1d' -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"invalid duration {text!r} (use e.g. 30s, 5m, 2h, 1d)")
    return float(m.group(1)) * _UNIT[m.group(2)]


def event_time(ev: dict[str, Any]) -> float | None:
    ts = ev.get("@timestamp")
    if not isinstance(ts, str):
        return None
    try:
        return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class EventFilter:
    task: str | None = None
    outcome: str | None = None  # "denied" | "allowed"
    since: float | None = None  # unix time
    component: str | None = None

    def __call__(self, ev: dict[str, Any]) -> bool:
        if self.task is not None and ev.get("labels", {}).get("task_id") != self.task:
            return False
        sk = ev.get("stockade", {})
        if self.outcome is not None and sk.get("decision") != self.outcome:
            return False
        if self.component is not None and sk.get("component") != self.component:
            return False
        if self.since is not None:
            t = event_time(ev)
            if t is None or t < self.since:
                return False
        return True


_COLOURS = {"denied": "\x1b[31m", "allowed": "\x1b[32m", "alert": "\x1b[1;35m"}
_RESET = "\x1b[0m"


def _dest(ev: dict[str, Any]) -> str:
    dns_q = ev.get("dns", {}).get("question")
    if dns_q:
        return f"{dns_q.get('name', '?')} {dns_q.get('type', '')}".strip()
    d = ev.get("destination", {})
    host = d.get("domain") or d.get("ip") or ""
    port = d.get("port")
    url = ev.get("url", {})
    path = url.get("path", "")
    method = ev.get("http", {}).get("request", {}).get("method", "")
    target = f"{host}:{port}" if host and port else host
    return " ".join(x for x in (method, target + path) if x)


def format_line(ev: dict[str, Any], colour: bool = False) -> str:
    """One readable line per event, for a person at a terminal."""
    ts = str(ev.get("@timestamp", ""))[11:23]
    sk = ev.get("stockade", {})
    e = ev.get("event", {})
    decision = sk.get("decision") or ("alert" if e.get("kind") == "alert" else "info")
    word = {"denied": "DENY ", "allowed": "ALLOW", "alert": "ALERT"}.get(decision, "INFO ")
    if sk.get("report_only"):
        word = "REPORT"
    if colour and decision in _COLOURS:
        word = f"{_COLOURS[decision]}{word}{_RESET}"
    labels = ev.get("labels", {})
    parts = [
        ts,
        word,
        f"{sk.get('component', '?'):<8}",
        f"{e.get('action', '?'):<19}",
        f"task={labels.get('task_id', '-')}",
    ]
    if labels.get("profile"):
        parts.append(f"profile={labels['profile']}")
    src = ev.get("source", {}).get("ip")
    if src:
        parts.append(f"src={src}")
    dest = _dest(ev)
    if dest:
        parts.append(dest)
    if e.get("reason"):
        parts.append(f"reason={e['reason']}")
    rule = ev.get("rule", {}).get("id")
    if rule:
        parts.append(f"rule={rule}")
    for key in ("api", "status", "bytes_up", "bytes_down"):
        if key in sk:
            parts.append(f"{key}={sk[key]}")
    if ev.get("message"):
        parts.append(f"- {ev['message']}")
    return " ".join(parts)
