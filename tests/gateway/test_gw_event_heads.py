"""The gateway's event heads: what the throttle reads of a connection's two events,
known before they are built (conn_events.decision_head / close_head), is what it
reads of the built events; and past a task's budget the events are counted unbuilt."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from stockade.gateway.conn_events import (
    ConnEvents,
    close_event,
    close_head,
    decision_event,
    decision_head,
)
from stockade.gateway.flow import FlowDecision
from stockade.gateway.metrics import GatewayMetrics
from stockade.gateway.relay import Relay
from stockade.gateway.tcp.conn import Conn
from stockade.policy.reasons import Reason

from stockade.events.summary import ThrottleSettings, head_of
from stockade.events.writer import EventWriter
from stockade.tasks import Task


@pytest.fixture(scope="module")
def sockets() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


_names = st.sampled_from([None, "", "pypi.org", "probe.t.stockade-fence-probe.invalid"])
_addrs = st.sampled_from([None, "", "10.0.0.1", "::1"])
_tasks = st.sampled_from([None, Task("t1", "10.1.0.2", "default"), Task("", "10.1.0.3", "")])
_origs = st.sampled_from([None, ("10.255.0.9", 443), ("::1", 80), ("[fe80::1]", 8443)])
_reasons = st.sampled_from(list(Reason))
_decisions = st.builds(FlowDecision, st.booleans(), _reasons,
                       st.sampled_from(["tls", "http", "tcp"]), st.integers(0, 65535),
                       host=_names, policy_version=st.sampled_from(["", "v1"]),
                       detail=st.sampled_from(["", "why"]))


def _conn(sock: socket.socket, task: Task | None, orig: Any, close_reason: Any = None) -> Conn:
    conn = Conn(7, "proxy", sock, ("10.1.0.2", 40000), 1.0, task=task,
                close_reason=close_reason)
    if orig is not None:
        conn.meta["orig"] = orig
    return conn


@given(_tasks, _origs, _decisions, _addrs)
def test_decision_head_is_the_built_events(
        sockets: tuple[socket.socket, socket.socket], task: Task | None, orig: Any,
        d: FlowDecision, dialled: str | None) -> None:
    conn = _conn(sockets[0], task, orig)
    assert decision_head(conn, d, dialled) == head_of(decision_event(conn, d, dialled))


@given(_tasks, _origs, _decisions, _addrs,
       st.sampled_from([None, "idle_timeout", *Reason]))
def test_close_head_is_the_built_events(
        sockets: tuple[socket.socket, socket.socket], task: Task | None, orig: Any,
        d: FlowDecision, dialled: str | None, close_reason: Any) -> None:
    conn = _conn(sockets[0], task, orig, close_reason)
    relay = Relay(sockets[0], sockets[1], count_up=lambda n: True, pool=None,
                  on_activity=lambda: None, first=b"hello")
    dialled = dialled or ""
    assert close_head(conn, d, dialled) == head_of(
        close_event(conn, relay, d, dialled, 2.0, 3.0))


def test_past_the_budget_the_events_are_counted_unbuilt(
        sockets: tuple[socket.socket, socket.socket], tmp_path: Any) -> None:
    writer = EventWriter(tmp_path / "events.jsonl", throttle=ThrottleSettings(task_events=4))
    built: list[str] = []

    def emit(ev: dict[str, Any]) -> None:
        built.append(ev["event"]["action"])
        writer.write(ev)

    events = ConnEvents(GatewayMetrics(), emit, writer.tally, writer.counts)
    task = Task("t1", "10.1.0.2", "default")
    d = FlowDecision(True, Reason.ALLOWED_BY_RULE, "tls", 443, host="pypi.org")
    relay = Relay(sockets[0], sockets[1], count_up=lambda n: True, pool=None,
                  on_activity=lambda: None)
    for _ in range(5):
        conn = _conn(sockets[0], task, None)
        events.allowed(conn, d, "10.0.0.1", 0.001, 1.0)
        events.closed(conn, relay, d, "10.0.0.1", 2.0, 3.0)
    # the task's first four events are built and written, the other six only counted
    assert built == ["connection_decision", "connection_close"] * 2
    assert (writer.written, writer.summarised) == (4, 6)
    totals = writer.end_task("t1")[0]["stockade"]["totals"]
    assert (totals["written"], totals["summarised"]) == (4, 6)
