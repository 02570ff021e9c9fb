"""The event throttle (stockade/events/summary.py) and the writer's per-task store: a
flood becomes a few verbatim events plus summaries whose counts add up exactly."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stockade.events import EventWriter, make_event, read_events, validate
from stockade.events.summary import OVERFLOW_KEYS, EventThrottle, ThrottleSettings
from stockade.events.taskstore import read_task_events, sweep


def _ev(task: str | None = "t1", *, decision: str = "denied", reason: str = "no_matching_rule",
        dst: str = "10.9.0.1", port: int = 1, component: str = "gateway",
        action: str = "connection_decision") -> dict[str, Any]:
    return make_event(component=component, action=action, decision=decision,  # type: ignore[arg-type]
                      reason=reason, task_id=task, profile="p", destination_ip=dst,
                      destination_port=port, transport="tcp")


def _counted(events: list[dict[str, Any]]) -> int:
    """Verbatim events plus summary counts (what the log says happened)."""
    n = 0
    for e in events:
        if e["event"]["action"] == "event_summary":
            n += e["stockade"]["summary"]["count"]
        elif e["event"]["action"] not in ("event_totals", "events_lost"):
            n += 1
    return n


def test_first_n_per_key_then_one_summary_per_window() -> None:
    th = EventThrottle(ThrottleSettings(verbatim_per_key=3, window_s=10))
    written = [th.offer(_ev(port=p), 100, 1000.0 + p / 1000) for p in range(100)]
    assert written[:3] == [True] * 3 and not any(written[3:])
    assert th.due(1005.0) == []  # the window has not ended
    (s,) = th.due(1011.0)
    validate(s)
    assert s["event"]["action"] == "event_summary" and s["event"]["reason"] == "no_matching_rule"
    assert s["destination"] == {"ip": "10.9.0.1"} and s["labels"]["task_id"] == "t1"
    assert s["stockade"]["summary"]["count"] == 97
    out = th.end_task("t1", 1012.0)
    assert [e["event"]["action"] for e in out] == ["event_totals"]
    validate(out[0])
    tot = out[0]["stockade"]["totals"]
    assert (tot["written"], tot["summarised"]) == (3, 97)
    assert tot["by"] == [{"decision": "denied", "reason": "no_matching_rule", "written": 3,
                          "summarised": 97}]


def test_task_budget_counts_allowed_events_too_and_lifecycle_always_passes() -> None:
    th = EventThrottle(ThrottleSettings(task_events=5, task_bytes=10**9))
    assert all(th.offer(_ev(decision="allowed", reason="allowed_by_rule"), 10, 1.0)
               for _ in range(5))
    assert not th.offer(_ev(decision="allowed", reason="allowed_by_rule"), 10, 1.0)
    assert not th.offer(_ev(), 10, 1.0)  # a first denial of a new key: budget is spent
    end = make_event(component="launcher", action="sandbox_lifecycle", task_id="t1")
    assert th.offer(end, 10, 1.0)
    assert th.offer(_ev(task=None), 10, 1.0)  # no task: nothing to budget it against
    out = th.end_task("t1", 2.0)
    summaries = [e for e in out if e["event"]["action"] == "event_summary"]
    assert sum(e["stockade"]["summary"]["count"] for e in summaries) == 2
    assert all(e["stockade"]["summary"]["budget_exhausted"] for e in summaries)


def test_byte_budget() -> None:
    th = EventThrottle(ThrottleSettings(task_events=10**6, task_bytes=1000))
    assert [th.offer(_ev(decision="allowed"), 400, 1.0) for _ in range(3)] == [True, True, False]


def test_keys_per_task_are_bounded_by_an_overflow_key() -> None:
    th = EventThrottle(ThrottleSettings(verbatim_per_key=1, keys_per_task=4))
    for i in range(1000):
        th.offer(_ev(dst=f"10.0.{i // 250}.{i % 250}"), 10, 1.0)
    assert th.keys("t1") == 5  # 4 + the overflow key
    out = th.end_task("t1", 2.0)
    assert _counted(out) + 5 == 1000  # 4 first-of-key events + 1 first of the overflow
    assert any(e.get("destination") is None and e["event"]["action"] == "event_summary"
               for e in out)


def test_tasks_are_bounded_the_oldest_is_ended_with_its_totals() -> None:
    th = EventThrottle(ThrottleSettings(tasks=3))
    for i in range(5):
        th.offer(_ev(task=f"t{i}"), 10, 1.0)
    assert th.tracked_tasks == 3
    evicted = th.due(1.0)
    assert sorted(e["labels"]["task_id"] for e in evicted) == ["t0", "t1"]


def test_tally_counts_without_writing() -> None:
    th = EventThrottle()
    th.tally(_ev(component="dns", action="dns_decision", reason="query_rate_exceeded"), 1.0)
    out = th.end_task("t1", 2.0)
    assert _counted(out) == 1
    assert out[-1]["stockade"]["totals"]["summarised"] == 1


_EVENTS = st.lists(
    st.tuples(st.sampled_from(["t1", "t2", "t3", None]),
              st.sampled_from(["denied", "allowed"]),
              st.sampled_from(["r1", "r2", "r3"]),
              st.integers(0, 40),  # destination
              st.integers(1, 900),  # size
              st.floats(0, 5),  # time step
              st.booleans()),  # tally instead of offer
    max_size=400)


@settings(max_examples=150, deadline=None)
@given(_EVENTS, st.integers(0, 5), st.integers(0, 50), st.integers(1, 8))
def test_counts_always_add_up_and_memory_stays_bounded(
        events: list[Any], per_key: int, budget: int, keys: int) -> None:
    th = EventThrottle(ThrottleSettings(verbatim_per_key=per_key, window_s=3, task_events=budget,
                                        task_bytes=budget * 300, keys_per_task=keys, tasks=2))
    now = 0.0
    sent: dict[str | None, int] = {}
    log: list[dict[str, Any]] = []
    for task, decision, reason, dst, size, step, tally in events:
        now += step
        ev = _ev(task=task, decision=decision, reason=reason, dst=f"10.0.0.{dst}")
        sent[task] = sent.get(task, 0) + 1
        if tally and task is not None:
            th.tally(ev, now)
        elif th.offer(ev, size, now):
            log.append(ev)
        log += th.due(now)
        assert th.tracked_tasks <= 2
        for t in ("t1", "t2", "t3"):
            assert th.keys(t) <= keys + OVERFLOW_KEYS + 1
    for t in ("t1", "t2", "t3"):
        log += th.end_task(t, now)
    log += th.due(now)
    for task, n in sent.items():
        mine = [e for e in log if e.get("labels", {}).get("task_id") == task]
        assert _counted(mine) == n
        if task is not None:
            totals = [e["stockade"]["totals"] for e in mine
                      if e["event"]["action"] == "event_totals"]
            assert sum(t["written"] + t["summarised"] for t in totals) == n


def test_writer_throttles_and_keeps_a_per_task_store(tmp_path: Path) -> None:
    w = EventWriter(tmp_path / "e.jsonl", max_bytes=4000, backups=1,
                    throttle=ThrottleSettings(verbatim_per_key=5), task_dir=tmp_path / "tasks")
    w.write(_ev(task="keep", dst="10.1.1.1", reason="important"))
    for i in range(5000):
        w.write(_ev(task="flood", port=i % 65535 + 1))
        # other tasks' allowed flows rotate the shared file (the throttle keeps the flood small)
        w.write(_ev(task=f"n{i % 50}", decision="allowed", reason="allowed_by_rule"))
    totals = w.end_task("flood")
    assert totals[0]["stockade"]["totals"] == {
        "written": 5, "summarised": 4995, "bytes": totals[0]["stockade"]["totals"]["bytes"],
        "by": [{"decision": "denied", "reason": "no_matching_rule", "written": 5,
                "summarised": 4995}]}
    stored = read_task_events(tmp_path / "tasks", "flood")
    assert _counted(stored) == 5000
    for e in stored:
        validate(e)
    # the important denial is long rotated out of the shared file, not out of its store
    shared = read_events(tmp_path / "e.jsonl") + read_events(tmp_path / "e.jsonl.1")
    assert not any(e["event"].get("reason") == "important" for e in shared)
    (kept,) = read_task_events(tmp_path / "tasks", "keep")
    assert kept["event"]["reason"] == "important"
    assert (tmp_path / "tasks" / "flood.jsonl").stat().st_size < 20_000


def test_task_store_is_capped_with_a_count_in_the_totals(tmp_path: Path) -> None:
    w = EventWriter(None, throttle=ThrottleSettings(verbatim_per_key=10**6, task_events=10**6,
                                                    task_bytes=10**9),
                    task_dir=tmp_path, task_store_bytes=3000)
    for i in range(100):
        w.write(_ev(port=i + 1))
    (tot,) = w.end_task("t1")
    stored = read_task_events(tmp_path, "t1")
    assert tot["stockade"]["totals"]["store_truncated"] == 100 - (len(stored) - 1)
    assert stored[-1]["event"]["action"] == "event_totals"
    validate(stored[-1])


def test_task_ids_that_are_not_file_names_stay_out_of_the_store(tmp_path: Path) -> None:
    w = EventWriter(None, throttle=ThrottleSettings(), task_dir=tmp_path / "s")
    w.write(_ev(task="../escape"))
    w.write(_ev(task="t1\n"))  # a name with a newline in it is not a task's file either
    assert list((tmp_path / "s").iterdir()) == []
    assert not (tmp_path / "escape.jsonl").exists()


def test_sweep_removes_old_task_files(tmp_path: Path) -> None:
    (tmp_path / "old.jsonl").write_text("{}\n")
    (tmp_path / "new.jsonl").write_text("{}\n")
    import os

    os.utime(tmp_path / "old.jsonl", (1000, 1000))
    assert sweep(tmp_path, 3600) == ["old"]
    assert [p.name for p in tmp_path.iterdir()] == ["new.jsonl"]


def test_close_flushes_pending_summaries(tmp_path: Path) -> None:
    w = EventWriter(tmp_path / "e.jsonl", throttle=ThrottleSettings(verbatim_per_key=1))
    for _ in range(10):
        w.write(_ev())
    w.close()
    evs = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert _counted(evs) == 10


def test_overflow_keys_are_bounded_too() -> None:
    th = EventThrottle(ThrottleSettings(verbatim_per_key=0, keys_per_task=2))
    for i in range(500):
        th.offer(_ev(dst=f"10.0.{i % 250}.1", reason=f"r{i % 100}"), 10, 1.0)
    assert th.keys("t1") == 2 + OVERFLOW_KEYS + 1
    assert _counted(th.end_task("t1", 2.0)) == 500


def test_totals_rows_are_bounded() -> None:
    th = EventThrottle(ThrottleSettings(verbatim_per_key=0))
    for i in range(1000):
        th.offer(_ev(reason=f"r{i}"), 10, 1.0)
    out = th.end_task("t1", 2.0)
    (tot,) = [e["stockade"]["totals"] for e in out if e["event"]["action"] == "event_totals"]
    assert len(tot["by"]) <= 257 and tot["summarised"] == 1000


def test_flush_due_writes_ended_windows_without_a_next_event(tmp_path: Path) -> None:
    """A quiet task's counts reach the disk once their window ends, not only when the
    task ends (a component SIGKILLed later would have lost them)."""
    w = EventWriter(tmp_path / "e.jsonl", throttle=ThrottleSettings(verbatim_per_key=1))
    for _ in range(10):
        w.write(_ev())
    w.flush_due(now=time.time() + 1)  # the window is still open: nothing yet
    assert _counted(read_events(tmp_path / "e.jsonl")) == 1
    w.flush_due(now=time.time() + 61)
    evs = read_events(tmp_path / "e.jsonl")
    assert _counted(evs) == 10
    assert [e["event"]["action"] for e in evs] == ["connection_decision", "event_summary"]


def test_a_components_own_summary_keeps_its_count() -> None:
    """A name-budget summary (`suppressed_events`) is written even past the task budget
    and the per-key limit: folded into our counts it would become one event."""
    th = EventThrottle(ThrottleSettings(verbatim_per_key=1, task_events=1, task_bytes=10**9))
    assert th.offer(_ev(decision="allowed", reason="allowed_by_rule"), 10, 1.0)  # budget spent
    own = make_event(component="gateway", action="connection_decision", decision="denied",
                     reason="name_budget_exceeded", task_id="t1", profile="p",
                     extra={"name_budget": "entry_names", "suppressed_events": 7})
    assert all(th.offer(own, 10, 1.0) for _ in range(3))
    assert not th.offer(_ev(), 10, 1.0)  # an ordinary denial still is only counted
    (totals,) = [e for e in th.end_task("t1", 2.0) if e["event"]["action"] == "event_totals"]
    rows = {r["reason"]: r for r in totals["stockade"]["totals"]["by"]}
    assert rows["name_budget_exceeded"]["written"] == 3


def test_key_of_reads_each_part_once_and_tolerates_missing_or_odd_parts() -> None:
    from stockade.events.summary import key_of

    ev = {"event": {"action": "connection_decision", "reason": "no_matching_rule"},
          "stockade": {"component": "gateway", "decision": "denied"},
          "destination": {"ip": "192.0.2.1"}}
    assert key_of(ev) == ("gateway", "connection_decision", "denied", "no_matching_rule",
                          "192.0.2.1")
    ev["destination"] = {"domain": "a.test", "ip": "192.0.2.1"}  # the name wins
    assert key_of(ev)[4] == "a.test"
    # parts that are missing or not objects read as empty, never raise
    assert key_of({"event": "x", "stockade": None}) == ("", "", "none", "", "")
