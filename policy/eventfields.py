"""The event fields a verdict contributes, so every component reports verdicts alike.

`make_event(component=..., action=..., **verdict_fields(v), ...)` fills `event.outcome`,
`event.reason`, `rule.id`, `rule.ruleset` and `stockade.report_only` the same way in the
gateway, the DNS firewall and the rules tooling.
"""

from __future__ import annotations

from typing import Any

from .model import Verdict


def verdict_fields(v: Verdict) -> dict[str, Any]:
    return {
        "decision": "allowed" if v.allowed else "denied",
        "reason": str(v.reason),
        "rule_id": v.rule_id,
        "policy_version": v.policy_version,
        "report_only": v.report_only,
    }
