"""CPU per connection of the gateway's two events, built first or counted from heads.

One connection's events (gateway/conn_events.py `ConnEvents.allowed` + `closed`: the
decision and close events, their metrics) go to a real `EventWriter` made as the gateway
makes it (`EventSettings().writer(...)`: throttle, per-task store, signing chain), in a
temporary directory. Two ways, side by side in interleaved rounds in one process:

- `built`: `ConnEvents` without `counted`, so every event is built and offered to the
  throttle (the code before the heads);
- `heads`: with the writer's `counts`, as the gateway service runs it: an event the
  throttle only counts is counted from its head and never built.

Each is timed under its task's event budget (a fresh task per round: every event
written) and past it (a task whose budget is spent: every event only counted). CPU is
this thread's (`time.thread_time_ns`); the table gives the median over `--rounds` rounds
(the two ways' order alternating) in microseconds per connection.

    .venv/bin/python bench/conn_events_bench.py [--conns 1000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import itertools
import socket
import statistics
import tempfile
import time
from pathlib import Path

from stockade.gateway.conn_events import ConnEvents
from stockade.gateway.flow import FlowDecision
from stockade.gateway.metrics import GatewayMetrics
from stockade.gateway.relay import Relay
from stockade.gateway.tcp.conn import Conn
from stockade.policy.reasons import Reason

from stockade.events.settings import EventSettings
from stockade.events.writer import EventWriter
from stockade.tasks import Task

_ids = itertools.count()


def _round(events: ConnEvents, relay: Relay, sock: socket.socket, task: Task,
           conns: int) -> float:
    """CPU microseconds per connection of `conns` connections' two events."""
    d = FlowDecision(True, Reason.ALLOWED_BY_RULE, "tls", 443, host="pypi.org",
                     policy_version="v1")
    t0 = time.thread_time_ns()
    for _ in range(conns):
        conn = Conn(next(_ids), "proxy", sock, ("10.1.0.2", 40000), 1.0, task=task)
        events.allowed(conn, d, "10.0.0.1", 0.0005, time.time())
        events.closed(conn, relay, d, "10.0.0.1", time.time(), time.monotonic())
    return (time.thread_time_ns() - t0) / conns / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--conns", type=int, default=1000, help="connections per round")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    a, b = socket.socketpair()
    relay = Relay(a, b, count_up=lambda n: True, pool=None, on_activity=lambda: None)
    budget = EventSettings().throttle().task_events
    with tempfile.TemporaryDirectory() as tmp:
        writer: EventWriter = EventSettings().writer(
            Path(tmp) / "events.jsonl", Path(tmp) / "tasks", stdout=False)
        ways = {"built": ConnEvents(GatewayMetrics(), writer.write, writer.tally),
                "heads": ConnEvents(GatewayMetrics(), writer.write, writer.tally,
                                    writer.counts)}
        spent = {name: Task(f"spent-{name}", "10.1.0.2", "default") for name in ways}
        for name, ev in ways.items():  # past the budget: every event only counted
            _round(ev, relay, a, spent[name], budget)
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            order = list(ways.items())
            for name, ev in order if r % 2 else reversed(order):  # neither always first
                fresh = Task(f"t{r}-{name}", "10.1.0.2", "default")
                # under the budget: half the budget's events, all of them written
                n = min(args.conns, budget // 2)
                times.setdefault((name, "under"), []).append(_round(ev, relay, a, fresh, n))
                writer.end_task(fresh.task_id)
                times.setdefault((name, "past"), []).append(
                    _round(ev, relay, a, spent[name], args.conns))
        summarised = writer.summarised
    a.close()
    b.close()
    print(f"gateway events per connection (decision + close), median of {args.rounds}"
          f" rounds; task budget {budget} events")
    print(f"{'path':8} {'under budget us':>16} {'past budget us':>15}")
    for name in ways:
        print(f"{name:8} {statistics.median(times[(name, 'under')]):16.1f}"
              f" {statistics.median(times[(name, 'past')]):15.1f}")
    print(f"(events counted, not written: {summarised})")


if __name__ == "__main__":
    main()
