"""The DNS firewall's tunnelling guards, applied to the names this path resolves.

A task has one set of name budgets for its DNS queries and for the names its SNI, Host
and CONNECT authorities make the gateway resolve (the service passes the firewall's
`GuardState`); names being resolved right now count against them until they resolve.
"""

from __future__ import annotations

import time
from typing import Literal, NamedTuple

from stockade.policy.decide import decide_name
from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from stockade.net.resolver import Resolver
from stockade.tasks import Task

from ..dns.guards import GuardDenial, GuardState, NameLimits, name_violation
from ..flow import FlowDecision
from ..name_refusals import budget_denial

UNRESOLVABLE_DETAIL = "too many distinct unresolvable names under this allow entry"


class Reservation(NamedTuple):
    """A name counted as in flight under (task id, budget key) until `release`."""

    key: tuple[str, str]
    host: str
    pending: dict[str, int]  # the in-flight names under `key` (shared by reservations)


class NameGate:
    def __init__(self, guards: GuardState, limits: NameLimits, resolver: Resolver) -> None:
        self.guards = guards
        self.limits = limits
        self.resolver = resolver
        # (task id, budget key) -> names being resolved right now, with a count each
        self._resolving: dict[tuple[str, str], dict[str, int]] = {}

    def guard(self, task: Task, d: FlowDecision, ruleset: RuleSet) -> GuardDenial | None:
        """Why the flow's name must not be resolved, else None. Enforced in report mode
        too, as on the DNS path: they guard the resolver, not the policy."""
        if d.host is None:
            return None  # a literal address (cidr rule): nothing is resolved
        bad = name_violation(d.host, self.limits)
        if bad is not None:
            return GuardDenial(bad, "the name looks like a tunnelling channel; not resolved")
        now = time.monotonic()
        rule = budget_key(ruleset, task, d.host)
        over = self.guards.admit_name(task.task_id, ruleset, task.profile, d.host, rule, now)
        if over is not None:
            return budget_denial(self.guards, task.task_id, rule or "", over, now)
        # on a cache miss the upstream query itself would carry the data out
        if self.resolver.cached(d.host, now) is None and self.guards.unresolvable_exhausted(
            task.task_id, rule or "", d.host, now
        ):
            return GuardDenial(Reason.UNRESOLVABLE_NAME_BUDGET, UNRESOLVABLE_DETAIL)
        return None

    def reserve(
        self, task: Task, ruleset: RuleSet, host: str
    ) -> Reservation | Literal[False] | None:
        """Before resolving `host`: the authoritative budget check, synchronous with
        registering the name as in flight, so concurrent connections cannot all slip
        under the cap. None: a cached name, nothing reserved; False: over the budget."""
        if self.resolver.cached(host) is not None:
            return None
        rule = budget_key(ruleset, task, host)
        key = (task.task_id, rule)
        pending = self._resolving.setdefault(key, {})
        now = time.monotonic()
        if self.guards.unresolvable_exhausted_pending(task.task_id, rule, host, now, pending):
            if not pending:
                del self._resolving[key]
            return False
        pending[host] = pending.get(host, 0) + 1
        return Reservation(key, host, pending)

    def release(self, r: Reservation) -> None:
        pending = r.pending
        left = pending[r.host] - 1
        if left:
            pending[r.host] = left
        else:
            del pending[r.host]
            if not pending:
                self._resolving.pop(r.key, None)

    def record_unresolvable(self, task: Task, ruleset: RuleSet, host: str) -> None:
        """Counts against the task's budget exactly as a DNS query would."""
        rule = budget_key(ruleset, task, host)
        self.guards.record_unresolvable(task.task_id, rule, host, time.monotonic())


def budget_key(ruleset: RuleSet, task: Task, host: str) -> str:
    """The allow entry a name's budgets are kept under: the one the DNS firewall charges
    (`decide_name`), so both paths draw from the same budgets."""
    return decide_name(ruleset, task.profile, host).rule_id or ""
