"""A DNS flood from one task: every query is decided (an event, or a count in a summary,
rate-limited ones included) or counted as dropped by the kernel (the socket's drop
counter), and the counts add up to the queries sent."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import dns.message
from dns_harness import Harness, start_harness
from dns_upstream import Upstream
from stockade.policy.ruleset import RuleSet

from stockade.events import EventWriter
from stockade.events.summary import ThrottleSettings


def _query(i: int) -> bytes:
    q = dns.message.make_query("allowed.test", "A")
    q.id = i & 0xFFFF
    return q.to_wire()


def _decided(events: list[dict[str, Any]]) -> int:
    """dns_decision events written, plus the counts in the task's dns summaries."""
    n = 0
    for e in events:
        act = e["event"]["action"]
        if act == "dns_decision" and e.get("labels", {}).get("task_id") == "task-1":
            n += 1
        elif act == "event_summary" and e["stockade"]["summary"]["action"] == "dns_decision" \
                and "kernel_dropped" not in e["stockade"]["summary"]:
            n += e["stockade"]["summary"]["count"]
    return n


def _kernel_dropped(events: list[dict[str, Any]]) -> int:
    return sum(e["stockade"]["summary"].get("kernel_dropped", 0) for e in events
               if e["event"]["action"] == "event_summary")


def _sender(h: Harness) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((h.client_ip, 0))
    return s


async def test_rate_limited_queries_are_counted(upstream: Upstream, ruleset: RuleSet) -> None:
    writer = EventWriter(None, throttle=ThrottleSettings())
    h = await start_harness(upstream, ruleset, writer=writer, queries_per_second=0.001,
                            query_burst=5)
    s = _sender(h)
    s.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        for i in range(300):  # one at a time, each answered: nothing dropped
            await loop.sock_sendto(s, _query(i), (h.host, h.port))
            await asyncio.wait_for(loop.sock_recvfrom(s, 4096), 3)
    finally:
        s.close()
        await h.fw.stop()
    writer.end_task("task-1")
    assert _decided(h.events) == 300
    assert _kernel_dropped(h.events) == 0
    # a handful of lines, not 300
    assert len(h.events) < 30


async def test_kernel_dropped_datagrams_are_counted(upstream: Upstream, ruleset: RuleSet) -> None:
    writer = EventWriter(None, throttle=ThrottleSettings())
    h = await start_harness(upstream, ruleset, writer=writer, queries_per_second=0.001,
                            query_burst=5)
    h.fw._udp[0].sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s = _sender(h)
    sent = 3000
    try:
        # sent while the event loop is blocked here: the firewall's small buffer overflows
        for i in range(sent):
            s.sendto(_query(i), (h.host, h.port))
        for _ in range(100):  # until the backlog is drained
            await asyncio.sleep(0.05)
    finally:
        s.close()
        await h.fw.stop()  # reports the drops not yet reported
    writer.end_task("task-1")
    dropped = _kernel_dropped(h.events)
    assert dropped > 0
    assert _decided(h.events) + dropped == sent
