"""Run the policy tests of `rules/tests/*.yaml` against a loaded rule set.

`expect` describes what the *rules* decide: in a report-mode profile a request the
rules deny is `deny` even though report mode lets it through (`report_only`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date

from .decide import decide
from .model import PolicyTestCase, Verdict
from .ruleset import RuleSet
from .targets import TargetError, parse_target


@dataclass(frozen=True, slots=True)
class TestResult:
    __test__ = False  # not a pytest test class
    case: PolicyTestCase
    verdict: Verdict | None
    failures: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return not self.failures


def run_case(ruleset: RuleSet, case: PolicyTestCase, today: date | None = None) -> TestResult:
    try:
        facts = parse_target(case.target, case.method)
    except TargetError as e:
        return TestResult(case, None, (str(e),))
    v = decide(ruleset, case.profile, facts, today=today)
    got = "allow" if v.allowed and not v.report_only else "deny"
    failures = []
    if got != case.expect:
        failures.append(f"expected {case.expect}, got {got} ({v.reason})")
    if case.rule is not None and v.rule_id != case.rule:
        failures.append(f"expected rule {case.rule!r}, got {v.rule_id!r}")
    if case.reason is not None and v.reason != case.reason:
        failures.append(f"expected reason {case.reason}, got {v.reason}")
    return TestResult(case, v, tuple(failures))


def run_tests(
    ruleset: RuleSet, cases: tuple[PolicyTestCase, ...] | None = None, today: date | None = None
) -> list[TestResult]:
    return [run_case(ruleset, c, today) for c in (ruleset.tests if cases is None else cases)]
