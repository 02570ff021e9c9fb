"""The two faces of a usage report: a table for people, a JSON document for scripts."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from .usage import EntryUsage, UsageReport

_SHOWN = 3  # names listed per "served" / "denied near" line; JSON has them all


def _ts(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def entry_json(u: EntryUsage) -> dict[str, Any]:
    return {
        "profile": u.profile, "entry": u.entry, "kind": u.kind, "target": u.target,
        "origin": u.origin or None, "owner": u.owner,
        "review_by": u.review_by.isoformat() if u.review_by else None,
        "expires": u.expires.isoformat() if u.expires else None,
        "hits": u.hits, "tasks": len(u.tasks), "bytes_up": u.bytes_up,
        "bytes_down": u.bytes_down, "last_use": _ts(u.last_use),
        "served": dict(u.served.most_common()),
        "denials_near": dict(u.denials_near.most_common()),
        "status": u.status, "stale": u.stale,
    }  # fmt: skip


def report_json(r: UsageReport, files: list[str], bad_lines: dict[str, int]) -> dict[str, Any]:
    return {
        "since": _ts(r.since), "until": _ts(r.until), "files": files,
        "events": r.events, "undated_events": r.undated, "bad_lines": bad_lines,
        "unattributed_allowed": r.unattributed_allowed,
        "unknown_rules": [{"profile": p, "rule": rid, "hits": n}
                          for (p, rid), n in sorted(r.unknown.items())],
        "stale": len(r.stale),
        "entries": [entry_json(u) for u in r.entries],
    }  # fmt: skip


_HEAD = ("PROFILE", "ENTRY", "KIND", "HITS", "TASKS", "BYTES", "LAST USE", "OWNER", "STATUS")


def _row(u: EntryUsage) -> tuple[str, ...]:
    return (u.profile, u.entry, u.kind, str(u.hits), str(len(u.tasks)),
            _size(u.bytes_up + u.bytes_down), _ts(u.last_use) or "-", u.owner or "-",
            ", ".join(u.status) or "ok")  # fmt: skip


def _names(label: str, c: Any) -> str:
    top = ", ".join(f"{n} ({k})" for n, k in c.most_common(_SHOWN))
    more = f", +{len(c) - _SHOWN} more" if len(c) > _SHOWN else ""
    return f"    {label}: {top}{more}"


def report_table(r: UsageReport) -> list[str]:
    """Aligned rows, each followed by its wildcard's served names and nearby denials."""
    rows = [_row(u) for u in r.entries]
    widths = [max(len(x[i]) for x in [_HEAD, *rows]) for i in range(len(_HEAD))]
    out = ["  ".join(h.ljust(w) for h, w in zip(_HEAD, widths, strict=True)).rstrip()]
    for u, row in zip(r.entries, rows, strict=True):
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if u.served:
            out.append(_names("served", u.served))
        if u.denials_near:
            out.append(_names("denied near", u.denials_near))
    for (p, rid), n in sorted(r.unknown.items()):
        out.append(f"{p}: {n} event(s) name rule {rid!r}, which these rules do not have")
    if r.unattributed_allowed:
        out.append(f"{r.unattributed_allowed} allowed event(s) were only counted in "
                   "summaries (no rule id): not attributed to an entry")  # fmt: skip
    return out
