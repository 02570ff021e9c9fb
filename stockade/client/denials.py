"""Denials at a glance: the events of a run or an exec counted by reason and destination
(`stockade run`'s closing summary, the MCP tools' results). Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any


def _destination(ev: dict[str, Any]) -> str:
    dst = ev.get("destination") if isinstance(ev.get("destination"), dict) else {}
    host = dst.get("domain") or dst.get("ip") or ev.get("url", {}).get("domain") or "?"
    port = dst.get("port")
    if port is None:
        return str(host)
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _reason(ev: dict[str, Any]) -> str:
    event = ev.get("event") if isinstance(ev.get("event"), dict) else {}
    return str(event.get("reason") or event.get("action") or "denied")


def summarize_denials(denials: Iterable[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """(reason, destination, count), the most frequent first (then by name, stable)."""
    counts = Counter((_reason(ev), _destination(ev)) for ev in denials
                     if isinstance(ev, dict))
    return sorted(((r, d, n) for (r, d), n in counts.items()),
                  key=lambda t: (-t[2], t[0], t[1]))


def denial_summary(denials: Iterable[dict[str, Any]], *, most: int = 10) -> list[str]:
    """Short lines for a person: `3x dns_denied  evil.example:53`; [] without denials."""
    rows = summarize_denials(denials)
    if not rows:
        return []
    total = sum(n for _, _, n in rows)
    lines = [f"{total} denial{'s' if total != 1 else ''}:"]
    lines += [f"  {n}x {reason}  {dst}" for reason, dst, n in rows[:most]]
    if len(rows) > most:
        rest = sum(n for _, _, n in rows[most:])
        lines.append(f"  … {rest} more in {len(rows) - most} other groups")
    return lines
