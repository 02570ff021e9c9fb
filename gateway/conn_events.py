"""The TCP path's events: one `connection_decision` per connection, one
`connection_close` per relayed one, and the batch that writes allowed flows' events a
moment later, off the latency path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from stockade.policy.reasons import Reason

from stockade.events import make_event
from stockade.events.summary import EventHead

from .flow import FlowDecision
from .metrics import GatewayMetrics
from .relay import Relay
from .tcp.conn import Conn
from .tls_retry import Refused

log = logging.getLogger("stockade.gateway")
Emit = Callable[[dict[str, Any]], None]
# the event writer's `counts`: True when its throttle only counted the event (not built)
Counted = Callable[[EventHead], bool]
EVENT_DELAY_S = 0.01  # how long an allowed flow's events may wait to be written in a batch
EVENT_SLICE = 4  # deferred events written per event-loop round


def decision_event(
    conn: Conn,
    d: FlowDecision,
    dialled: str | None,
    now: float | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    task = conn.task
    orig = conn.meta.get("orig")
    extra = {**(extra or {}), "listener": conn.listener, "connection_id": conn.id}
    if orig is not None:
        extra["original_destination"] = f"{orig[0]}:{orig[1]}"
    return make_event(
        component="gateway",
        action="connection_decision",
        decision="allowed" if d.allowed else "denied",
        reason=str(d.reason),
        task_id=task.task_id if task else None,
        profile=task.profile if task else None,
        policy_version=d.policy_version or None,
        rule_id=d.rule_id,
        report_only=d.report_only,
        source_ip=conn.peer[0],
        source_port=conn.peer[1],
        destination_domain=d.host,
        destination_ip=dialled,
        destination_port=d.port or None,
        transport="tcp",
        protocol=d.protocol,
        message=d.detail or None,
        extra=extra,
        now=now,
    )


def decision_head(conn: Conn, d: FlowDecision, dialled: str | None) -> EventHead:
    """What the throttle reads of `decision_event(conn, d, dialled)` (no `extra`)."""
    task = conn.task
    orig = conn.meta.get("orig")
    # a refused flow's address is its original destination's (probemark.destination_address)
    address = dialled or (str(orig[0]).strip("[]") if orig is not None else "")
    return EventHead(
        (task.task_id or None) if task else None, task.profile if task else None,
        ("gateway", "connection_decision", "allowed" if d.allowed else "denied",
         str(d.reason), d.host or dialled or ""),
        d.host or "", address)


def close_head(conn: Conn, d: FlowDecision, dialled: str) -> EventHead:
    """What the throttle reads of `close_event(conn, ..., d, dialled, ...)`."""
    reason = conn.close_reason
    task = conn.task
    return EventHead(
        (task.task_id or None) if task else None, task.profile if task else None,
        ("gateway", "connection_close",
         "denied" if reason in DENIED_CLOSES else "none",
         str(reason or "closed"), d.host or dialled or ""),
        d.host or "", dialled or "")


def close_event(
    conn: Conn, relay: Relay, d: FlowDecision, dialled: str, now: float | None, ended: float
) -> dict[str, Any]:
    reason = conn.close_reason
    task = conn.task
    return make_event(
        component="gateway",
        action="connection_close",
        decision="denied" if reason in DENIED_CLOSES else None,
        reason=reason or "closed",
        task_id=task.task_id if task else None,
        profile=task.profile if task else None,
        policy_version=d.policy_version or None,
        rule_id=d.rule_id,
        source_ip=conn.peer[0],
        source_port=conn.peer[1],
        destination_domain=d.host,
        destination_ip=dialled or None,
        destination_port=d.port or None,
        transport="tcp",
        protocol=d.protocol,
        extra={
            "bytes_up": relay.bytes_up,
            "bytes_down": relay.bytes_down,
            "duration_s": round(ended - conn.started, 6),
            "connection_id": conn.id,
        },
        now=now,
    )


class EventBatch:
    """Runs event builders a moment later, in a batch.

    Building and writing an event costs tens of microseconds; done inline it lands on
    the set-up latency of the flow itself or of the connection that arrives next. The
    batch starts at most EVENT_DELAY_S later (callers pass the wall-clock time of what
    they log, so timestamps are exact) and runs in order, EVENT_SLICE events per loop
    round so that connections arriving meanwhile wait for one slice, not the batch;
    `flush()` (the gateway's stop) writes everything, so none is lost on shutdown.
    """

    def __init__(self) -> None:
        self.pending: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # bound by the gateway's start

    def defer(self, fn: Callable[..., None], *args: Any) -> None:
        self.pending.append((fn, args))
        if self._handle is None:
            loop = self.loop or asyncio.get_running_loop()
            self._handle = loop.call_later(EVENT_DELAY_S, self._slice)

    def flush(self) -> None:
        """Build and write every deferred event now."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._write(len(self.pending))

    def _slice(self) -> None:
        self._handle = None
        self._write(EVENT_SLICE)
        if self.pending:
            self._handle = (self.loop or asyncio.get_running_loop()).call_soon(self._slice)

    def _write(self, limit: int) -> None:
        batch = self.pending
        for _ in range(min(limit, len(batch))):
            fn, args = batch.popleft()
            try:
                fn(*args)
            except Exception:  # one bad event must not lose the rest of the batch
                log.exception("gateway: writing an event failed")


class ConnEvents:
    """Counts and writes the TCP path's events (`tally`: a refusal counted into the
    task's event summaries and totals instead of written). With `counted` (the writer's
    `counts`) an event its throttle would only count is counted without being built:
    past a task's event budget that is every event of the task."""

    def __init__(self, metrics: GatewayMetrics, emit: Emit, tally: Emit,
                 counted: Counted | None = None) -> None:
        self.metrics = metrics
        self.emit = emit
        self.tally = tally
        self.counted = counted
        self.numbers = metrics.tally  # the metrics' per-connection counts
        self.batch = EventBatch()

    def decision(
        self,
        conn: Conn,
        d: FlowDecision,
        dialled: str | None,
        now: float | None = None,
        extra: dict[str, Any] | None = None,
        emit: Emit | None = None,
    ) -> None:
        conn.decided = True
        profile = conn.task.profile if conn.task else None
        self.numbers.decided("allowed" if d.allowed else "denied", str(d.reason), profile or "")
        # a caller's `extra` may carry its own count or override the key: built in full
        if emit is None and extra is None and self.counted is not None and \
                self.counted(decision_head(conn, d, dialled)):
            return
        (emit or self.emit)(decision_event(conn, d, dialled, now, extra))

    def allowed(
        self, conn: Conn, d: FlowDecision, dialled: str, elapsed: float, now: float
    ) -> None:
        self.numbers.timed(elapsed)
        self.decision(conn, d, dialled, now)

    def closed(
        self, conn: Conn, relay: Relay, d: FlowDecision, dialled: str, now: float, ended: float
    ) -> None:
        self.numbers.relayed(relay.bytes_up, relay.bytes_down)
        if self.counted is not None and self.counted(close_head(conn, d, dialled)):
            return
        self.emit(close_event(conn, relay, d, dialled, now, ended))

    def retry_refused(self, conn: Conn, d: FlowDecision, dialled: str, r: Refused) -> None:
        """An allowed TLS flow refused after a HelloRetryRequest (relay_gate.py): a second,
        denied decision (destination_mismatch when the second ClientHello named another
        destination), written in the batch after the allowed one."""
        refused = FlowDecision(False, r.reason, d.protocol, d.port, host=d.host, ip=d.ip,
                               rule_id=d.rule_id, policy_version=d.policy_version,
                               detail=r.detail)  # fmt: skip
        self.batch.defer(self.decision, conn, refused, dialled, time.time(), _RETRY_PHASE)

    def cut_short(self, conn: Conn, policy_version: str) -> None:
        """A task's connection that ended before its flow was decided (the task ended
        while its first bytes were awaited or its connection was still queued, the socket
        failed first, or a bug ended it): still one denied decision, so the task's
        evidence counts every connection it made. Shutdown closes are left undecided."""
        if conn.decided or conn.task is None:
            return
        why = _CUT_SHORT.get(conn.close_reason)
        if why is None:
            return
        orig = conn.meta.get("orig")
        self.decision(conn, FlowDecision(False, why[0], "tcp", orig[1] if orig else 0,
                                         policy_version=policy_version, detail=why[1]), None)


_RETRY_PHASE = {"phase": "hello_retry"}
# a connection_close with one of these reasons was ended by a refusal: decision "denied"
DENIED_CLOSES = frozenset({
    Reason.UPLOAD_LIMIT, Reason.TASK_ENDED,
    # after a HelloRetryRequest (relay_gate.py): the second ClientHello, or what came instead
    Reason.DESTINATION_MISMATCH, Reason.PROTOCOL_UNRECOGNISED, Reason.HEAD_TOO_LARGE,
})  # fmt: skip
# close reason -> (the decision's reason, its detail) for a connection cut short
_CUT_SHORT: dict[str | None, tuple[Reason, str]] = {
    None: (Reason.PROTOCOL_UNRECOGNISED, "the connection failed before its flow was decided"),
    Reason.TASK_ENDED: (Reason.TASK_ENDED, "the task ended before the flow was decided"),
    Reason.INTERNAL_ERROR: (
        Reason.INTERNAL_ERROR, "an internal error ended the connection before its decision"),
}
