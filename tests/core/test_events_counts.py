"""EventThrottle.counts: an event only counted is counted from its head, never built,
and every decision, summary and total is what offering the built event gives."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stockade.events import make_event
from stockade.events.probemark import ProbeWindow, marker
from stockade.events.summary import EventThrottle, ThrottleSettings, head_of
from stockade.events.writer import EventWriter

TARGET = "10.255.0.9"
SMALL = ThrottleSettings(verbatim_per_key=2, window_s=5.0, task_events=6, task_bytes=900,
                         keys_per_task=3, tasks=3,
                         probes=ProbeWindow(frozenset({TARGET}), window_s=4.0))

_domains = st.sampled_from([None, None, None, "a.example", "b.example", "c.example",
                            "d.example", "a.example", marker("tls", "t1"), ""])
_ips = st.sampled_from([None, "10.0.0.1", "10.0.0.2", TARGET])


@st.composite
def events(draw: st.DrawFn) -> dict[str, Any]:
    action = draw(st.sampled_from(["connection_decision"] * 3 + [
        "connection_close", "dns_decision", "sandbox_lifecycle", "event_summary"]))
    orig = draw(st.sampled_from([None, f"{TARGET}:443", "10.0.0.3:80", "[::1]:443"]))
    return make_event(
        component=draw(st.sampled_from(["gateway", "dns", "launcher"])),
        action=action,
        decision=draw(st.sampled_from(["allowed", "denied", "denied", None])),
        reason=draw(st.sampled_from([None, "no_rule_matched", "closed", "rule_allow"])),
        task_id=draw(st.sampled_from([None, "t1", "t1", "t1", "t2", "t2", "t3", "t4"])),
        profile=draw(st.sampled_from([None, "p"])),
        destination_domain=draw(_domains),
        destination_ip=draw(_ips),
        destination_port=443,
        dns_question=draw(st.sampled_from([None] * 8 + [{"name": marker("dns", "t2")},
                                                        {"name": "x.example"}])),
        message=draw(st.sampled_from([None, "m" * 10, "m" * 200])),
        extra=None if orig is None else {"original_destination": orig},
        now=0.0,
    )


# (event, its line's size, seconds since the previous one)
_steps = st.lists(st.tuples(events(), st.integers(1, 300), st.floats(0.0, 3.0)),
                  min_size=30, max_size=60)


def _replay(steps: list[tuple[dict[str, Any], int, float]], *, heads: bool,
            counted: list[tuple[int, int]] | None = None
            ) -> tuple[list[Any], list[dict[str, Any]]]:
    """Every step's outcome and every summary/totals event, offering each event built
    (heads=False) or asking `counts` first (heads=True; `counted` gets the task's
    events written and bytes of each event counted from its head)."""
    th = EventThrottle(SMALL)
    now, outcomes, out = 1000.0, [], []
    for ev, size, dt in steps:
        now += dt
        if heads and th.counts(head_of(ev), now):
            t = th._tasks[head_of(ev).task_id or ""]
            if counted is not None:
                counted.append((t.events, t.bytes))
            outcomes.append(False)
        else:
            outcomes.append(th.offer(ev, size, now))
        out += th.due(now)
        outcomes.append(sorted(th.keys(t) for t in ("t1", "t2", "t3", "t4")))
    now += 1.0
    out += th.due(now)
    for task in ("t1", "t2", "t3", "t4"):
        out += th.end_task(task, now)
    return outcomes, out


@settings(max_examples=150)
@given(_steps)
def test_counted_from_heads_is_the_full_path(steps: list[tuple[dict[str, Any], int, float]]
                                             ) -> None:
    assert _replay(steps, heads=True) == _replay(steps, heads=False)


def test_both_counted_paths_agree_on_a_known_sequence() -> None:
    """The sequences above reach `counts` (about 3% of their events); this one reaches
    both of its paths: a denied key whose window the budget marked, then the budget."""
    deny, allow = _decision("t1", 0, "denied"), _decision("t1", 1)
    steps = [(deny, 10, 0.1)] * 3 + [(deny, 890, 0.1)] + [(deny, 10, 0.1)] * 2 \
        + [(allow, 10, 0.1)] * 8
    counted: list[tuple[int, int]] = []
    assert _replay(steps, heads=True, counted=counted) == _replay(steps, heads=False)
    events_written = [e for e, _ in counted]
    assert any(e < SMALL.task_events for e in events_written)  # the marked window
    assert any(e >= SMALL.task_events for e in events_written)  # past the budget


@settings(max_examples=100)
@given(_steps)
def test_counts_only_says_yes_where_offer_says_no(
        steps: list[tuple[dict[str, Any], int, float]]) -> None:
    th, twin = EventThrottle(SMALL), EventThrottle(SMALL)
    now = 1000.0
    for ev, size, dt in steps:
        now += dt
        counted = th.counts(head_of(ev), now)
        written = twin.offer(ev, size, now)
        assert not (counted and written)
        if not counted:
            assert th.offer(ev, size, now) == written


def _decision(task: str, n: int, decision: str = "allowed") -> dict[str, Any]:
    return make_event(component="gateway", action="connection_decision", decision=decision,  # type: ignore[arg-type]
                      reason="rule_allow", task_id=task, profile="p",
                      destination_domain=f"h{n}.example", destination_port=443)


def test_past_the_budget_every_event_is_counted_from_its_head() -> None:
    th = EventThrottle(ThrottleSettings(task_events=3))
    heads = [head_of(_decision("t", n)) for n in range(10)]
    assert not th.counts(heads[0], 1.0)  # a task's first event: offer decides
    for n in range(3):
        assert th.offer(_decision("t", n), 100, 1.0)
    assert all(th.counts(h, 2.0) for h in heads[3:])
    totals = th.end_task("t", 3.0)[-1]["stockade"]["totals"]
    assert (totals["written"], totals["summarised"]) == (3, 7)


def test_past_verbatim_only_once_the_window_is_marked() -> None:
    """Under the budget a denied key past verbatim is counted with `budget` set by its
    size: the head alone cannot say, so it is built until the window is marked."""
    s = ThrottleSettings(verbatim_per_key=1, task_events=100, task_bytes=1000)
    th = EventThrottle(s)
    deny = _decision("t", 0, "denied")
    assert th.offer(deny, 10, 1.0)  # verbatim
    assert not th.counts(head_of(deny), 1.0)  # past verbatim, window unmarked
    assert not th.offer(deny, 10, 1.0)
    assert not th.counts(head_of(deny), 1.0)
    assert not th.offer(deny, 995, 1.0)  # over by its size: the window is marked
    assert th.counts(head_of(deny), 1.0)
    summary = th.end_task("t", 2.0)[0]["stockade"]["summary"]
    assert (summary["count"], summary["budget_exhausted"]) == (3, True)


def test_the_writer_counts_without_writing(tmp_path: Any) -> None:
    w = EventWriter(tmp_path / "events.jsonl", throttle=ThrottleSettings(task_events=2))
    labelled: list[str] = []
    w.label_with(lambda task: labelled.append(task) or {"team": "x"})
    for n in range(2):
        assert w.write(_decision("t", n))
    assert w.counts(head_of(_decision("t", 2)))
    assert (w.written, w.summarised) == (2, 1)
    assert not EventWriter(tmp_path / "other.jsonl").counts(head_of(_decision("t", 3)))
    totals = w.end_task("t")[0]["stockade"]["totals"]
    assert (totals["written"], totals["summarised"]) == (2, 1)
    assert labelled == ["t"]  # looked up once, at the task's first event
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all('"team":"x"' in line for line in lines)
