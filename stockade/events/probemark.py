"""The fence self-test's marker names (launcher/selftest.py sends them; the event
throttle, summary.py, recognises their events so probes never spend a task's budgets).

They live in a zone that can never resolve (RFC 6761 `.invalid`): no rule allows them
and no resolver answers them."""

from __future__ import annotations

MARKER_ZONE = "stockade-fence-probe.invalid"


def marker(role: str, task_id: str) -> str:
    return f"{role}.{task_id}.{MARKER_ZONE}"


def is_marker(name: object) -> bool:
    return isinstance(name, str) and name.rstrip(".").endswith("." + MARKER_ZONE)
