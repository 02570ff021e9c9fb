"""A sandbox's start and operator events (pure); its one end event is ending.py's."""

from __future__ import annotations

from typing import Any

from stockade.events import make_event

from .isolation import PROVIDED_ISOLATION
from .state import SandboxRecord


def start_event(rec: SandboxRecord, policy_version: str | None, ttl: float,
                isolation: dict[str, Any],
                selftest: dict[str, Any] | None = None) -> dict[str, Any]:
    """`isolation`: the fields of isolation.decide_backend (a downgrade names both tiers);
    `selftest`: the fence self-test's report (fence.py)."""
    return make_event(
        component="launcher", action="sandbox_lifecycle", task_id=rec.task_id,
        profile=rec.profile, policy_version=policy_version, source_ip=rec.guest_ip,
        message="sandbox started" if "isolation_requested" not in isolation else (
            f"sandbox started at {PROVIDED_ISOLATION} grade "
            f"(the profile asks for {isolation['isolation_requested']})"),
        extra={"lifecycle": "start", "ttl_s": ttl, **isolation, "selftest": selftest},
    )


def snapshot_fallback_event(rec: SandboxRecord, why: str) -> dict[str, Any]:
    """A microVM booted cold because its shape's snapshot template could not be used."""
    return make_event(
        component="launcher", action="sandbox_lifecycle", task_id=rec.task_id or None,
        profile=rec.profile or None, source_ip=rec.guest_ip,
        message=f"microVM booted cold: {why}", extra={"lifecycle": "snapshot_fallback"},
    )
