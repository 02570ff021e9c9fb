"""The fence self-test's probe events spend none of a task's event budget
(stockade/events/summary.py, probemark.py): a task's budget after its self-test is the
budget of a task without one, and a sandbox naming markers itself gets only a few."""

from __future__ import annotations

from typing import Any

from stockade.events import make_event
from stockade.events.probemark import ProbeWindow, marker
from stockade.events.summary import PROBE_EVENTS, EventThrottle, ThrottleSettings

BUDGET = ThrottleSettings(verbatim_per_key=3, task_events=40, keys_per_task=8)


def _conn(task: str, *, dst: str | None = None, ip: str | None = "10.9.0.1",
          decision: str = "denied", port: int = 443) -> dict[str, Any]:
    return make_event(component="gateway", action="connection_decision",
                      decision=decision,  # type: ignore[arg-type]
                      reason="no_matching_rule" if decision == "denied" else None,
                      task_id=task, profile="p", destination_domain=dst,
                      destination_ip=None if dst else ip, destination_port=port,
                      transport="tcp")


def _dns(task: str, name: str) -> dict[str, Any]:
    return make_event(component="dns", action="dns_decision", decision="denied",
                      reason="no_matching_rule", task_id=task, profile="p",
                      dns_question={"name": name + ".", "type": "A"})


def _selftest(task: str) -> list[dict[str, Any]]:
    """The events one self-test leaves: named DNS and TLS probes, HTTP probes whose Host
    is a marker (launcher/selftest.py plan)."""
    return [_dns(task, marker("dns", task)), _dns(task, marker("resolver", task)),
            _conn(task, dst=marker("tls", task)), _conn(task, dst=marker("host", task), port=22),
            _conn(task, dst=marker("exempt", task), port=8081),
            *[_conn(task, dst=marker(f"control{p}", task), port=p) for p in (9090, 9091)]]


def _workload(task: str) -> list[dict[str, Any]]:
    """What the task's command does after: allowed flows and denied ones to many hosts."""
    evs = [_conn(task, decision="allowed", ip=f"10.1.0.{i % 5}") for i in range(25)]
    return evs + [_conn(task, ip=f"10.2.0.{i % 12}", port=i) for i in range(60)]


def _verdicts(th: EventThrottle, events: list[dict[str, Any]]) -> list[bool]:
    return [th.offer(ev, 300, 1000.0 + i / 1000) for i, ev in enumerate(events)]


def _totals(th: EventThrottle, task: str) -> dict[str, dict[str, Any]]:
    return {e["stockade"]["component"]: e["stockade"]["totals"]
            for e in th.end_task(task, 2000.0) if e["event"]["action"] == "event_totals"}


def test_a_tasks_budget_after_its_selftest_is_a_budget_without_one() -> None:
    with_test, without = EventThrottle(BUDGET), EventThrottle(BUDGET)
    assert all(_verdicts(with_test, _selftest("a1")))  # every probe's event is written
    after = _verdicts(with_test, _workload("a1"))
    plain = _verdicts(without, _workload("b2"))
    assert after == plain and not all(plain)  # the budget ran out at the same event
    assert with_test.keys("a1") == without.keys("b2")
    # the probes are in the task's totals: written + summarised is still what was decided
    totals, plain_totals = _totals(with_test, "a1"), _totals(without, "b2")
    assert totals["dns"]["written"] == 2
    assert totals["gateway"]["written"] == plain_totals["gateway"]["written"] + 5
    assert totals["gateway"]["bytes"] == plain_totals["gateway"]["bytes"]


def test_a_sandbox_naming_markers_gets_only_a_few_off_the_budget() -> None:
    th = EventThrottle(ThrottleSettings(verbatim_per_key=3, task_events=0))
    flood = [_conn("c3", dst=marker("tls", "c3")) for _ in range(PROBE_EVENTS + 10)]
    verdicts = _verdicts(th, flood)
    assert verdicts == [True] * PROBE_EVENTS + [False] * 10  # then the spent budget holds
    assert th.offer(_conn("c3", dst="tls.c3.example.invalid"), 300, 1001.0) is False


WINDOW = ProbeWindow(frozenset({"192.0.2.1"}), 5.0)


def _raw(task: str, ip: str = "192.0.2.1") -> dict[str, Any]:
    """The raw-IP TLS probe's denial: no name, the self-test's raw address as the
    original destination (the gateway dialled nothing)."""
    ev = _conn(task, ip=None)
    ev["stockade"]["original_destination"] = f"{ip}:443"
    return ev


def _udp(task: str) -> dict[str, Any]:
    return make_event(component="launcher", action="bypass_attempt", decision="denied",
                      reason="bypass_attempt", task_id=task, profile="p",
                      destination_ip="192.0.2.1", destination_port=443, transport="udp")


def _allowed_dns(task: str) -> dict[str, Any]:
    return make_event(component="dns", action="dns_decision", decision="allowed",
                      task_id=task, profile="p", dns_question={"name": "ok.test.", "type": "A"})


def _spent(th: EventThrottle, task: str) -> int:
    """The bytes of the task's budget spent (every component's totals carry the task's)."""
    return max(t["bytes"] for t in _totals(th, task).values())


def test_unmarked_probes_pass_once_per_kind_within_the_window() -> None:
    th = EventThrottle(ThrottleSettings(task_events=3, probes=WINDOW))
    probes = [_raw("d4"), _udp("d4"), _allowed_dns("d4")]
    assert [th.offer(ev, 300, 1000.0 + i) for i, ev in enumerate(probes)] == [True] * 3
    # the budget of three events is untouched: the workload's first three pass, not four
    work = [_conn("d4", ip=f"10.2.0.{i}") for i in range(4)]
    assert [th.offer(ev, 300, 1003.0) for ev in work] == [True, True, True, False]
    assert _spent(th, "d4") == 900


def test_a_sandbox_mimicking_the_unmarked_probes_gains_nothing() -> None:
    th = EventThrottle(ThrottleSettings(task_events=1000, probes=WINDOW))
    # the self-test's own (the first of each kind) pass off the budget ...
    assert th.offer(_raw("e5"), 300, 1000.0) and th.offer(_udp("e5"), 300, 1000.1)
    # ... a second of a kind in the window (past the allowance), one to another address,
    # and one after the window all spend the budget
    for ev, now in ((_raw("e5"), 1000.2), (_udp("e5"), 1000.3), (_raw("e5", "10.2.0.9"), 1000.4),
                    (_allowed_dns("e5"), 1006.0)):
        assert th.offer(ev, 100, now)
    assert _spent(th, "e5") == 400
    # a task whose first such flow comes after the window (its self-test was off and it
    # waited) gets nothing off its budget either
    late = EventThrottle(ThrottleSettings(task_events=1000, probes=WINDOW))
    late.offer(_conn("f6", ip="10.2.0.1"), 100, 1000.0)
    late.offer(_raw("f6"), 100, 1006.0)
    assert _spent(late, "f6") == 200
