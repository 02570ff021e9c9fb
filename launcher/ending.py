"""A sandbox's one end event (pure): who may write it and what it says.

Every sandbox gets exactly one `sandbox_lifecycle` end event, whoever removes it: its
run, a kill from another process, the reconcile of the launcher service or of the next
run. The claim is the removal of the sandbox's record from the shared state file (under
its flock, `cleanup.Cleaner.teardown`): only the caller whose teardown removed the record of a
sandbox that had started writes the end event, so a kill and a reconcile racing on one
orphan give one event, not two and not none.
"""

from __future__ import annotations

import time
from typing import Any, TypeGuard

from stockade.events import make_event

from .state import SandboxRecord


def end_due(rec: SandboxRecord | None) -> TypeGuard[SandboxRecord]:
    """The teardown that removed `rec` owes its end event (a sandbox that never reached
    `running` had no start event either, nor had a pooled one no task claimed)."""
    return rec is not None and rec.state not in ("starting", "pooled")


def lifecycle_reason(ended_by: str) -> str | None:
    return {"ttl": "ttl_expired", "limit": "resource_limit"}.get(ended_by)


def end_event(
    rec: SandboxRecord,
    ended_by: str,
    *,
    exit_code: int | None = None,
    duration_s: float | None = None,
    policy_version: str | None = None,
    accounting: dict[str, Any] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The end event; without `duration_s` it is the record's age (an orphan's run).
    `accounting`: the bypass counts and event totals (`denials.BypassCollector.end_accounting`)."""
    if duration_s is None:
        duration_s = max(0.0, (time.time() if now is None else now) - rec.started_at)
    extra: dict[str, Any] = {"lifecycle": "end", "ended_by": ended_by,
                             "duration_s": round(duration_s, 6)}
    if exit_code is not None:
        extra["exit_code"] = exit_code
    extra.update(accounting or {})
    return make_event(
        component="launcher", action="sandbox_lifecycle", task_id=rec.task_id,
        profile=rec.profile, policy_version=policy_version, source_ip=rec.guest_ip,
        reason=lifecycle_reason(ended_by), message=f"sandbox ended ({ended_by})",
        extra=extra, now=now,
    )
