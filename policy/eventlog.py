"""Recorded events as the rules tooling reads them: the events file and its rotations,
and one accessor per field whose name changed between event schemas.

Schema 2.0 (ECS) moved byte counts to `source.bytes` / `destination.bytes` and durations
to `event.duration` (nanoseconds); schema 1.0 files carry `stockade.bytes_up`,
`stockade.bytes_down`, `stockade.duration_s` / `stockade.latency_ms`. Rotated files keep
old lines, so every reader goes through the accessors here, never through a raw path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stockade.events.view import event_time

Event = dict[str, Any]

DECISIONS = frozenset(("connection_decision", "request_decision", "dns_decision"))


def get(ev: Event, dotted: str) -> Any:
    """The value at `a.b.c`, or None when any step is missing or not an object."""
    cur: Any = ev
    for part in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _count(ev: Event, new: str, old: str) -> int:
    for path in (new, old):
        v = get(ev, path)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return 0


def bytes_up(ev: Event) -> int:
    """Bytes the sandbox sent (schema 2.0 `source.bytes`, 1.0 `stockade.bytes_up`)."""
    return _count(ev, "source.bytes", "stockade.bytes_up")


def bytes_down(ev: Event) -> int:
    """Bytes the sandbox received (`destination.bytes`, 1.0 `stockade.bytes_down`)."""
    return _count(ev, "destination.bytes", "stockade.bytes_down")


def duration_s(ev: Event) -> float | None:
    """The event's duration in seconds: `event.duration` (ns), else the 1.0 fields."""
    ns = get(ev, "event.duration")
    if isinstance(ns, int | float) and not isinstance(ns, bool):
        return ns / 1e9
    for path, scale in (("stockade.duration_s", 1.0), ("stockade.latency_ms", 1e-3)):
        v = get(ev, path)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return v * scale
    return None


def when(ev: Event) -> float | None:
    """The event's time (epoch seconds), None when `@timestamp` is missing or malformed."""
    return event_time(ev)


def action(ev: Event) -> str | None:
    return get(ev, "event.action")


def profile(ev: Event) -> str | None:
    return get(ev, "labels.profile")


def task_id(ev: Event) -> str | None:
    return get(ev, "labels.task_id")


def rule_id(ev: Event) -> str | None:
    return get(ev, "rule.id")


def outcome(ev: Event) -> str | None:
    """"allowed" / "denied" / None, from `event.outcome` (success / failure)."""
    return {"success": "allowed", "failure": "denied"}.get(get(ev, "event.outcome"))


def destination(ev: Event) -> str | None:
    """The name asked for: `destination.domain`, else the request URL's or the DNS
    question's name; lower case, without a trailing dot."""
    name = get(ev, "destination.domain") or get(ev, "url.domain") or get(ev, "dns.question.name")
    return name.lower().rstrip(".") if isinstance(name, str) and name else None


def port(ev: Event) -> int | None:
    for path in ("destination.port", "url.port"):
        v = get(ev, path)
        if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536:
            return v
    return None


def allowed(ev: Event) -> bool:
    """Did the flow go through: allowed, or denied by the rules but let through in
    report mode (`stockade.report_only`; its outcome is already `success`)?"""
    return outcome(ev) == "allowed"


_ROTATED = re.compile(r"\.(\d+)$")


def event_files(path: str | Path) -> list[Path]:
    """`path` and its rotations (`path.1`, `path.2`, ...), oldest first."""
    p = Path(path)
    rotated = []
    for q in p.parent.glob(f"{p.name}.*"):
        m = _ROTATED.search(q.name)
        if m and q.name == f"{p.name}.{m.group(1)}":
            rotated.append((int(m.group(1)), q))
    out = [q for _, q in sorted(rotated, reverse=True)]
    return [*out, p] if p.exists() else out


@dataclass
class ReadStats:
    """What reading the files met besides events: nothing is skipped unsaid."""

    files: list[str] = field(default_factory=list)
    events: int = 0
    bad_lines: dict[str, int] = field(default_factory=dict)  # file -> lines not an event


def read_files(paths: list[Path], stats: ReadStats) -> Iterator[Event]:
    """Every event of `paths`, in order; a line that is not a JSON object is counted in
    `stats.bad_lines` (a torn last line after a crash, a foreign line) and skipped."""
    for p in paths:
        stats.files.append(str(p))
        with open(p, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    ev = None
                if not isinstance(ev, dict):
                    stats.bad_lines[str(p)] = stats.bad_lines.get(str(p), 0) + 1
                    continue
                stats.events += 1
                yield ev
