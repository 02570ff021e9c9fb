"""The fence self-test's marker names (launcher/selftest.py sends them; the event
throttle, summary.py, recognises their events so probes never spend a task's budgets).

They live in a zone that can never resolve (RFC 6761 `.invalid`): no rule allows them
and no resolver answers them."""

from __future__ import annotations

MARKER_ZONE = "stockade-fence-probe.invalid"
_ZONE_LABELS = tuple(MARKER_ZONE.encode().split(b"."))
# a task's probe events (or DNS queries) kept off its budgets: one self-test makes about
# ten; a sandbox that names markers itself gains no more than this
PROBES_PER_TASK = 32


def marker(role: str, task_id: str) -> str:
    return f"{role}.{task_id}.{MARKER_ZONE}"


def is_marker(name: object) -> bool:
    return isinstance(name, str) and name.rstrip(".").endswith("." + MARKER_ZONE)


def is_marker_labels(labels: tuple[bytes, ...]) -> bool:
    """A DNS question's labels (as received, any case) name a marker."""
    n = len(_ZONE_LABELS)
    return len(labels) > n and tuple(x.lower() for x in labels[-n:]) == _ZONE_LABELS
