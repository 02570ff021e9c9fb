"""What the launcher reports about a task's events when its sandbox ends.

- Bypass attempts: the nft counter (`nft.SET_BYPASS_COUNT`) counts every packet that
  reached a log rule; the NFLOG reader saw `logged` of them. The rest (over the log
  limit, or lost on the netlink socket) become one `event_summary` event, so verbatim
  bypass events + their summaries + this one add up to the counter.
- The end event's `event_totals`: every component's `event_totals` event found in the
  task's store (gateway, DNS, broker write theirs when the task is deregistered, the
  launcher its own right before the end event), summed per component.
- A run's denials: the denied events and denied summaries in the task's store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stockade.events import make_event, timestamp
from stockade.events.summary import SUMMARY_ACTION, TOTALS_ACTION

Event = dict[str, Any]


def unlogged_bypass_summary(task_id: str, profile: str | None, total: int, logged: int,
                            started: float, now: float) -> Event | None:
    """A summary of the blocked packets no NFLOG record reported, or None if none."""
    unlogged = total - logged
    if unlogged <= 0:
        return None
    return make_event(
        component="launcher", action=SUMMARY_ACTION, decision="denied",
        reason="bypass_attempt", task_id=task_id, profile=profile,
        message=f"{unlogged} more blocked packet(s) beyond the firewall's log rate limit",
        extra={"summary": {"action": "bypass_attempt", "count": unlogged,
                           "first": timestamp(started), "last": timestamp(now),
                           "window_s": max(now - started, 0.001), "budget_exhausted": False,
                           "unlogged": unlogged}},
        now=now,
    )


def logged_in_store(stored: list[Event]) -> int:
    """The bypass attempts the NFLOG reader reported, as the task's store holds them:
    verbatim events plus the throttle's summaries of them (not the unlogged summary).
    What a reconcile counts for an orphan whose run, and its reader's tally, are gone."""
    n = 0
    for ev in stored:
        st = ev.get("stockade", {})
        if st.get("component") != "launcher":
            continue
        action = ev.get("event", {}).get("action")
        summary = st.get("summary") or {}
        if action == "bypass_attempt":
            n += 1
        elif (action == SUMMARY_ACTION and summary.get("action") == "bypass_attempt"
              and "unlogged" not in summary):
            n += int(summary.get("count", 0))
    return n


def reader_totals_in(stored: list[Event]) -> bool:
    """A launcher's `event_totals` for the task is in its store: the NFLOG reader's, once
    it ended the task (then its bypass events and their summaries are all there)."""
    return any(ev.get("event", {}).get("action") == TOTALS_ACTION
               and ev.get("stockade", {}).get("component") == "launcher" for ev in stored)


def await_reader_totals(read: Callable[[], list[Event]], timeout: float = 3.0) -> list[Event]:
    """The task's store (`read()`) once another process's NFLOG reader has written its
    `event_totals` there: no wait when that reader reported nothing for the task, at most
    `timeout` when it is gone."""
    deadline = time.monotonic() + timeout
    while True:
        stored = read()
        if logged_in_store(stored) == 0 or reader_totals_in(stored) \
                or time.monotonic() >= deadline:
            return stored
        time.sleep(0.05)


def end_accounting(stored: list[Event], bypass_total: int, bypass_logged: int) -> dict[str, Any]:
    """The end event's `event_totals` and `bypass` fields."""
    totals: dict[str, dict[str, int]] = {}
    for ev in stored:
        if ev.get("event", {}).get("action") != TOTALS_ACTION:
            continue
        st = ev.get("stockade", {})
        t = st.get("totals", {})
        row = totals.setdefault(str(st.get("component")), {"written": 0, "summarised": 0})
        row["written"] += int(t.get("written", 0))
        row["summarised"] += int(t.get("summarised", 0))
    return {
        "event_totals": totals,
        "bypass": {"attempts": bypass_total, "logged": bypass_logged,
                   "unlogged": max(bypass_total - bypass_logged, 0)},
    }


def denials_of(stored: list[Event]) -> list[Event]:
    return [ev for ev in stored if ev.get("stockade", {}).get("decision") == "denied"]
