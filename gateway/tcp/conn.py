"""The connection table: every accepted connection, by task, with its upload count."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import socket
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from stockade.policy.holder import RulesHolder

from stockade.tasks import Task

from ..flow import Listener

# close reasons only (not decisions), so not Reason codes
IDLE_TIMEOUT = "idle_timeout"
SHUTDOWN = "shutdown"
_ids = itertools.count(1)


@dataclass(eq=False)
class Conn:
    """One accepted connection, tracked so deregistration/idle/shutdown can close it."""

    id: int
    listener: Listener
    client: socket.socket
    peer: tuple[str, int]
    started: float
    task: Task | None = None
    handler: asyncio.Task[None] | None = None
    last_activity: float = 0.0
    relaying: bool = False
    close_reason: str | None = None  # a Reason code, or "idle_timeout"
    decided: bool = False  # its connection_decision was made (written or tallied)
    meta: dict[str, Any] = field(default_factory=dict)

    def close(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason
        if self.handler is not None and not self.handler.done():
            self.handler.cancel()


class ConnTable:
    """The live connections, grouped by task (the per-task limit, closing a task's
    connections when it ends), and each task's uploaded bytes over all of them."""

    def __init__(self, rules: RulesHolder) -> None:
        self.rules = rules
        self.conns: set[Conn] = set()
        self.by_task: dict[str, set[Conn]] = {}
        # refused over the limit but still the task's until decided: its end closes them
        self.over_limit: dict[str, set[Conn]] = {}
        self.uploaded: dict[str, int] = {}  # task id -> bytes uploaded (all connections)
        self.relaying = 0  # connections in `conns` whose relay started (the live gauge)

    def open(self, kind: Listener, client: socket.socket, peer: tuple[Any, ...]) -> Conn:
        now = time.monotonic()
        conn = Conn(next(_ids), kind, client, (unmap_ip(peer[0]), peer[1]), now, last_activity=now)
        self.conns.add(conn)
        return conn

    def admit(self, conn: Conn, task: Task, limit: int) -> bool:
        """Count `conn` against its task's connection limit; False: over it."""
        group = self.by_task.setdefault(task.task_id, set())
        if len(group) >= limit:
            self.over_limit.setdefault(task.task_id, set()).add(conn)
            return False
        group.add(conn)
        return True

    def relay_started(self, conn: Conn) -> None:
        conn.relaying = True
        self.relaying += 1

    def forget(self, conn: Conn) -> None:
        if conn in self.conns:
            self.conns.remove(conn)
            if conn.relaying:
                self.relaying -= 1
        if conn.task is not None:
            for groups in (self.by_task, self.over_limit):
                group = groups.get(conn.task.task_id)
                if group is not None:
                    group.discard(conn)
                    if not group:
                        del groups[conn.task.task_id]

    def count_up(self, task: Task, n: int) -> bool:
        """Add `n` uploaded bytes to the task's total; False: past its egress cap (read
        from the current rules on every call, so a reload applies to live relays)."""
        used = self.uploaded.get(task.task_id, 0) + n
        self.uploaded[task.task_id] = used
        ruleset = self.rules.current
        profile = ruleset.profiles.get(task.profile)
        cap = profile.limits.egress_bytes if profile is not None else 0
        return used <= cap

    def close_task(self, task_id: str, reason: str) -> None:
        for conn in [*self.by_task.get(task_id, ()), *self.over_limit.get(task_id, ())]:
            conn.close(reason)
        self.uploaded.pop(task_id, None)

    def close_idle(self, idle_s: float) -> None:
        now = time.monotonic()
        for conn in list(self.conns):
            if conn.relaying and now - conn.last_activity > idle_s:
                conn.close(IDLE_TIMEOUT)


def touch(conn: Conn) -> None:
    conn.last_activity = time.monotonic()


@lru_cache(maxsize=4096)
def unmap_ip(ip: str) -> str:
    """'::ffff:10.0.0.1' -> '10.0.0.1' so registry lookups and logs use one form."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return str(addr.ipv4_mapped)
    return str(addr)
