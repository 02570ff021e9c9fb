"""Labels of a task (pure): the caller's free keys (user, agent, conversation, run id)
that every event of the task carries under ECS `labels`, next to `task_id` and `profile`.
Checked once here for the launcher's requests and the registry's control API alike."""

from __future__ import annotations

import re
from typing import Any

MAX_LABELS = 32
MAX_VALUE = 256
KEY_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,62}\Z")
RESERVED = frozenset({"task_id", "profile"})  # the events' own labels


class LabelError(ValueError):
    """A label set refused; `key` names the offending label (None: the set itself)."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


def check_labels(value: Any) -> dict[str, str]:
    """`value` as a label dict, or LabelError naming the first bad key."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LabelError(None, "labels must be an object of key: value strings")
    if len(value) > MAX_LABELS:
        raise LabelError(None, f"at most {MAX_LABELS} labels")
    out: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not KEY_RE.match(k):
            raise LabelError(str(k), "a label key is a lowercase letter, then up to 62 of "
                                     "a-z 0-9 _ . -")
        if k in RESERVED:
            raise LabelError(k, "reserved: events carry it already")
        if not isinstance(v, str) or len(v) > MAX_VALUE or not v.isprintable():
            raise LabelError(k, f"a label value is a string of at most {MAX_VALUE} "
                                "printable characters")
        out[k] = v
    return out
