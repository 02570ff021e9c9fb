"""Pure helpers for `stockade events`: parse --since/--until, filter events, format one
line, count events for --summary. No I/O: the CLI shell reads the file and prints. ECS
and OCSF lines alike: each helper reads an event through ecsview.ecs_view."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from datetime import time as dtime
from typing import Any

from .ecsview import ecs_view

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
SUMMARY_ACTION = "event_summary"


def parse_duration(text: str) -> float:
    """'90', '90s', '5m', '2h', '1d' -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"invalid duration {text!r} (use e.g. 30s, 5m, 2h, 1d)")
    return float(m.group(1)) * _UNIT[m.group(2)]


def parse_when(text: str, now: float) -> float:
    """--since/--until -> unix time: a duration back from `now` ('30s', '2h'), an ISO date
    or date and time ('2026-12-01', '2026-12-01T19:00', '2026-12-01 19:00:05+01:00', '…Z'),
    or a time of today ('19:00'). Without a zone it is local time, as the viewer prints."""
    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    s = text.strip()
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        dt = _time_of_today(s, now)
    if dt.tzinfo is None:
        dt = dt.astimezone()  # a naive datetime is local time
    return dt.timestamp()


def _time_of_today(s: str, now: float) -> datetime:
    try:
        t = dtime.fromisoformat(s)
    except ValueError:
        raise ValueError(
            f"invalid time {s!r} (use a duration like 30s or 2h, or an ISO date or time "
            "like 2026-12-01, 2026-12-01T19:00, 2026-12-01T19:00Z or 19:00)"
        ) from None
    today: date = datetime.fromtimestamp(now).date()  # local, like a naive time
    return datetime.combine(today, t)


def event_time(ev: dict[str, Any]) -> float | None:
    dt = _event_datetime(ev)
    return dt.timestamp() if dt is not None else None


def _event_datetime(ev: dict[str, Any]) -> datetime | None:
    ts = ev.get("@timestamp")
    if not isinstance(ts, str):
        return None
    try:
        return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    except ValueError:
        return None


def show_time(ev: dict[str, Any], utc: bool = False) -> str:
    """'2026-12-01 20:22:03.123 +01:00' (local) or '2026-12-01 19:22:03.123Z' (utc); an
    unreadable @timestamp is shown as it is, so the line still says what was there."""
    dt = _event_datetime(ev)
    if dt is None:
        return str(ev.get("@timestamp", "?"))
    if not utc:
        dt = dt.astimezone()
    text = f"{dt:%Y-%m-%d %H:%M:%S}.{dt.microsecond // 1000:03d}"
    if utc:
        return text + "Z"
    offset = dt.utcoffset()
    minutes = int(offset.total_seconds() // 60) if offset is not None else 0
    sign = "-" if minutes < 0 else "+"
    hours, mins = divmod(abs(minutes), 60)
    return f"{text} {sign}{hours:02d}:{mins:02d}"


def _obj(ev: dict[str, Any], key: str) -> dict[str, Any]:
    """ev[key] when it is an object; a foreign or damaged line may hold anything there."""
    v = ev.get(key)
    return v if isinstance(v, dict) else {}


@dataclass(frozen=True)
class EventFilter:
    task: str | None = None
    outcome: str | None = None  # "denied" | "allowed"
    since: float | None = None  # unix time, inclusive
    until: float | None = None  # unix time, inclusive
    component: str | None = None
    actions: frozenset[str] | None = None  # any of these event.action values
    reasons: frozenset[str] | None = None  # any of these event.reason values
    labels: tuple[tuple[str, str], ...] = ()  # every labels.k == v

    def __call__(self, ev: dict[str, Any]) -> bool:
        ev = ecs_view(ev)
        labels = _obj(ev, "labels")
        sk = _obj(ev, "stockade")
        e = _obj(ev, "event")
        wanted = (
            (self.task, labels.get("task_id")),
            (self.outcome, sk.get("decision")),
            (self.component, sk.get("component")),
        )
        if any(want is not None and got != want for want, got in wanted):
            return False
        if self.actions is not None and e.get("action") not in self.actions:
            return False
        if self.reasons is not None and e.get("reason") not in self.reasons:
            return False
        if any(labels.get(k) != v for k, v in self.labels):
            return False
        return self._in_window(ev)

    def _in_window(self, ev: dict[str, Any]) -> bool:
        if self.since is None and self.until is None:
            return True
        t = event_time(ev)
        if t is None:
            return False  # a time filter cannot vouch for an event without a time
        return (self.since is None or t >= self.since) and (self.until is None or t <= self.until)


_COLOURS = {"denied": "\x1b[31m", "allowed": "\x1b[32m", "alert": "\x1b[1;35m"}
_RESET = "\x1b[0m"


def _dest(ev: dict[str, Any]) -> str:
    dns_q = _obj(_obj(ev, "dns"), "question")
    if dns_q:
        return f"{dns_q.get('name', '?')} {dns_q.get('type', '')}".strip()
    d = _obj(ev, "destination")
    host = d.get("domain") or d.get("ip") or ""
    port = d.get("port")
    path = _obj(ev, "url").get("path", "")
    method = _obj(_obj(ev, "http"), "request").get("method", "")
    target = f"{host}:{port}" if host and port else host
    return " ".join(str(x) for x in (method, f"{target}{path}") if x)


def _bytes(ev: dict[str, Any]) -> str | None:
    """'bytes=↑12 ↓512': source.bytes/destination.bytes (schema 2.0), or the
    stockade.bytes_up/bytes_down of files written before the fields moved."""
    sk = _obj(ev, "stockade")
    up = _obj(ev, "source").get("bytes", sk.get("bytes_up"))
    down = _obj(ev, "destination").get("bytes", sk.get("bytes_down"))
    if up is None and down is None:
        return None
    return f"bytes=↑{'-' if up is None else up} ↓{'-' if down is None else down}"


def _decision_word(ev: dict[str, Any], colour: bool) -> str:
    sk = _obj(ev, "stockade")
    alert = _obj(ev, "event").get("kind") == "alert"
    decision = sk.get("decision") or ("alert" if alert else "info")
    word = {"denied": "DENY ", "allowed": "ALLOW", "alert": "ALERT"}.get(decision, "INFO ")
    if sk.get("report_only"):
        word = "REPORT"
    if colour and decision in _COLOURS:
        word = f"{_COLOURS[decision]}{word}{_RESET}"
    return word


def format_line(ev: dict[str, Any], colour: bool = False, utc: bool = False) -> str:
    """One readable line per event, for a person at a terminal."""
    ev = ecs_view(ev)
    sk = _obj(ev, "stockade")
    e = _obj(ev, "event")
    labels = _obj(ev, "labels")
    parts = [
        show_time(ev, utc),
        _decision_word(ev, colour),
        f"{sk.get('component', '?'):<8}",
        f"{e.get('action', '?'):<19}",
        f"task={labels.get('task_id', '-')}",
    ]
    optional = (
        ("profile=", labels.get("profile")),
        ("src=", _obj(ev, "source").get("ip")),
        ("", _dest(ev)),
        ("reason=", e.get("reason")),
        ("rule=", _obj(ev, "rule").get("id")),
        ("api=", sk.get("api")),
        ("status=", _obj(_obj(ev, "http"), "response").get("status_code", sk.get("status"))),
        ("", _bytes(ev)),
        ("- ", ev.get("message")),
    )
    parts.extend(f"{prefix}{value}" for prefix, value in optional if value)
    return " ".join(parts)


@dataclass(frozen=True)
class CountRow:
    action: str
    decision: str
    reason: str
    count: int


def count_events(events: Iterable[dict[str, Any]]) -> list[CountRow]:
    """--summary: events by (action, decision, reason), most first. An event_summary adds
    its stockade.summary.count to the row of the action it summarised (it stands for that
    many events not written one by one), so the counts are what the components decided."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for ev in map(ecs_view, events):
        e = _obj(ev, "event")
        sk = _obj(ev, "stockade")
        action, n = str(e.get("action") or "?"), 1
        summary = _obj(sk, "summary")
        if action == SUMMARY_ACTION and isinstance(summary.get("count"), int):
            action, n = str(summary.get("action") or SUMMARY_ACTION), summary["count"]
        counts[(action, str(sk.get("decision") or "-"), str(e.get("reason") or "-"))] += n
    rows = [CountRow(a, d, r, n) for (a, d, r), n in counts.items()]
    return sorted(rows, key=lambda row: (-row.count, row.action, row.decision, row.reason))


def format_counts(rows: list[CountRow]) -> list[str]:
    """A plain table: count, action, decision, reason; then the total."""
    out = [f"{'count':>8}  {'action':<19} {'decision':<8} reason"]
    out += [f"{r.count:>8}  {r.action:<19} {r.decision:<8} {r.reason}" for r in rows]
    out.append(f"{sum(r.count for r in rows):>8}  total")
    return out


def counts_json(rows: list[CountRow]) -> dict[str, Any]:
    """--summary --json: one object."""
    return {
        "total": sum(r.count for r in rows),
        "counts": [
            {"action": r.action, "decision": r.decision, "reason": r.reason, "count": r.count}
            for r in rows
        ],
    }
