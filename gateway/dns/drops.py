"""Datagrams the kernel dropped before the DNS firewall could read them (a full socket
receive buffer), turned into `event_summary` events: every query a sandbox sent is then
either decided (an event or a count in a summary) or counted here.

The count is the socket's own drop counter, read with getsockopt(SO_MEMINFO) (the value
/proc/net/udp shows as `drops`); it is per socket, not per task (the kernel drops a
datagram before anyone knows its sender), so these summaries carry no task id. Pure but
for `read_drops`.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from stockade.events import make_event, timestamp
from stockade.events.summary import SUMMARY_ACTION

SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)  # Linux >= 3.16; Python has no constant
_SK_MEMINFO_DROPS = 8  # index of the drop counter in the u32 array
REPORT_EVERY_S = 10.0  # at most one summary per socket this often (the first at once)


def read_drops(sock: socket.socket) -> int | None:
    """The socket's cumulative drop count, or None where the kernel cannot tell."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * (_SK_MEMINFO_DROPS + 1))
    except OSError:
        return None
    if len(raw) < 4 * (_SK_MEMINFO_DROPS + 1):
        return None
    return int(struct.unpack_from("=I", raw, 4 * _SK_MEMINFO_DROPS)[0])


class DropReporter:
    """Turns readings of a (u32, wrapping) drop counter into summary events."""

    def __init__(self, listen: str, first_reading: int | None, now: float) -> None:
        self.listen = listen
        self._last = first_reading or 0
        self._pending = 0
        self._first = now
        self._reported = float("-inf")
        self.total = 0

    def reading(self, value: int | None, now: float, *,
                final: bool = False) -> dict[str, Any] | None:
        """Feed a reading; returns a summary event when one is due."""
        if value is not None:
            delta = (value - self._last) & 0xFFFFFFFF
            self._last = value
            if delta:
                if not self._pending:
                    self._first = now
                self._pending += delta
                self.total += delta
        if not self._pending or (not final and now - self._reported < REPORT_EVERY_S):
            return None
        n, self._pending, self._reported = self._pending, 0, now
        return make_event(
            component="dns", action=SUMMARY_ACTION, decision="denied",
            reason="kernel_dropped", transport="udp", protocol="dns",
            message=f"{n} DNS datagram(s) to {self.listen} dropped by the kernel "
                    "(receive buffer full) before they could be decided",
            extra={"summary": {"action": "dns_decision", "count": n,
                               "first": timestamp(self._first), "last": timestamp(now),
                               "window_s": max(now - self._first, 0.001),
                               "budget_exhausted": False, "kernel_dropped": n},
                   "listen": self.listen},
            now=now,
        )
