"""The TCP path's name-budget refusals: how each is logged, and the end-of-task summary.

The budgets themselves are the DNS firewall's (`dns/namebudget.py`, one `GuardState` for
both paths); this only turns a refusal into a `GuardDenial` (logged once per entry and
budget, then counted) and the counted ones into `connection_decision` summary events.
"""

from __future__ import annotations

from typing import Any

from stockade.policy.reasons import Reason

from stockade.events import make_event
from stockade.tasks.registry import Task

from .dns.guards import GuardDenial, GuardState
from .dns.namebudget import DETAIL, Budget

PATH = "gateway"


def budget_denial(
    guards: GuardState, task_id: str, rule: str, budget: Budget, now: float
) -> GuardDenial:
    extra, log = guards.names.refusal(task_id, PATH, rule, budget, now)
    return GuardDenial(Reason.NAME_BUDGET_EXCEEDED, DETAIL[budget], extra, log=log)


def name_budget_summaries(guards: GuardState, task: Task) -> list[dict[str, Any]]:
    """One event per entry and budget whose refusals were counted but not logged."""
    return [
        make_event(
            component="gateway",
            action="connection_decision",
            decision="denied",
            reason=str(Reason.NAME_BUDGET_EXCEEDED),
            task_id=task.task_id,
            profile=task.profile,
            rule_id=s.rule or None,
            transport="tcp",
            message=s.message,
            extra=s.extra,
        )
        for s in guards.names.take_summaries(task.task_id, PATH)
    ]
