"""What a sandbox tried outside its fence: the NFLOG reader that turns each logged packet
into a `bypass_attempt` event, its tallies per sandbox, and the end event's accounting of
denials (what was logged, what the rate limit only counted, every component's totals)."""

from __future__ import annotations

import contextlib
import functools
import os
import select
import threading
import time
from collections.abc import Container
from typing import Any

from stockade.events import EventWriter, make_event
from stockade.events.taskstore import read_task_events, store_size

from .accounting import (
    await_reader_totals,
    denials_of,
    end_accounting,
    logged_in_store,
    unlogged_bypass_summary,
)
from .deregistration import DEREGISTERING
from .nflog import LogRecord, NflogSocket
from .selftest import without_probe_events
from .state import SandboxRecord, StateFile

FOREIGN_CHECK_S = 0.25  # how often the reader looks for sandboxes gone elsewhere


class BypassCollector:
    """One launcher process's NFLOG reader and its per-sandbox tallies. `live`: the task
    ids this process runs (their tallies end with their own end event)."""

    def __init__(self, state: StateFile, events: EventWriter, nflog_group: int,
                 task_events_dir: str, live: Container[str]) -> None:
        self.state, self.events, self.group = state, events, nflog_group
        self.task_events_dir, self.live = task_events_dir, live
        self.ifindex: dict[int, tuple[str, str]] = {}  # ifindex -> (task_id, profile)
        # per sandbox: NFLOG records this process's reader handled, dropped at its end or
        # by a reconcile (the nft bypass counter travels in SandboxRecord.bypass)
        self.logged: dict[str, int] = {}
        # sandboxes whose record this process's teardown removed and whose end event
        # (end_accounting) is still to come: not ended as "gone elsewhere" meanwhile
        self.ending: set[str] = set()
        self.bound = False
        self._foreign_check = 0.0  # when the reader last looked for sandboxes gone elsewhere
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticks = 0
        self._cv = threading.Condition()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="stockade-nflog")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # wake the reader from its select (else every close waited up to its 0.5 s
        # timeout); what the kernel queued before is still handled on the way out
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=3)

    def _loop(self) -> None:
        sock: NflogSocket | None = None
        while not self._stop.is_set():
            if sock is None:
                try:
                    sock = NflogSocket(self.group)
                    self.bound = True
                except OSError:
                    # another launcher holds the group and reports for every sandbox
                    self._stop.wait(1.0)
                    continue
            try:
                ready = self._read(sock)
            except Exception:  # the reader must survive anything: reopen and go on
                sock.close()
                sock = None
                self.bound = False
                continue
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                with self._cv:
                    self._ticks += 1
                    self._cv.notify_all()
        if sock is not None:
            sock.close()

    def _read(self, sock: NflogSocket) -> list[Any]:
        ready, _, _ = select.select([sock, self._wake_r], [], [], 0.5)
        # records first, then the drain request: all queued before it are handled
        for r in sock.recv_ready():
            self.handle_log_record(r)
        if self.logged and time.monotonic() - self._foreign_check >= FOREIGN_CHECK_S:
            self._foreign_check = time.monotonic()
            self.end_tasks_gone_elsewhere(self.state.read())
        return ready

    def wait_drain(self) -> None:
        """Let records the kernel already queued reach the events file before reading it."""
        if self._thread is None or not self.bound:
            return
        with self._cv:
            target = self._ticks + 1
            os.write(self._wake_w, b"x")
            self._cv.wait_for(lambda: self._ticks >= target, timeout=0.5)

    def task_for_ifindex(self, ifindex: int | None) -> tuple[str, str] | None:
        if ifindex is None:
            return None
        hit = self.ifindex.get(ifindex)
        if hit is not None:
            return hit
        for r in self.state.read().values():  # a sandbox of another launcher process
            if r.ifindex == ifindex and r.state != DEREGISTERING:
                return r.task_id, r.profile
        return None

    def handle_log_record(self, r: LogRecord) -> dict[str, Any] | None:
        owner = self.task_for_ifindex(r.ifindex)
        if owner is None:
            return None
        task_id, profile = owner
        # any launcher's sandbox: whoever removes it here reports the tally
        self.logged[task_id] = self.logged.get(task_id, 0) + 1
        what = r.prefix.split(":", 1)[-1] or "blocked"
        ev = make_event(
            component="launcher", action="bypass_attempt", decision="denied",
            reason="bypass_attempt", task_id=task_id, profile=profile,
            rule_id=f"launcher:{what}", source_ip=r.src, source_port=r.sport,
            destination_ip=r.dst, destination_port=r.dport, transport=r.transport,
            message=f"sandbox traffic outside the gateway and broker blocked ({what})",
            extra={"firewall": what},
        )
        self.events.write(ev)
        return ev

    def end_tasks_gone_elsewhere(self, records: dict[str, SandboxRecord]) -> None:
        """This reader's pending summaries and `event_totals` of sandboxes another process
        removed (and wrote the end event of): written once their record is gone (or only
        a pending deregistration), not left in memory until this writer closes."""
        present = {t for t, r in records.items() if r.state != DEREGISTERING}
        for tid in [t for t in list(self.logged)
                    if t not in present and t not in self.ending and t not in self.live]:
            self.logged.pop(tid, None)
            self.events.end_task(tid)

    def forget(self, task_id: str) -> None:
        """The remover's end event reports the sandbox; this writer's tally ends here."""
        self.logged.pop(task_id, None)
        self.events.end_task(task_id)

    def denials(self, task_id: str, since: int = 0) -> list[dict[str, Any]]:
        """The task's denial events from every component, read from its per-task store
        (stockade/events/taskstore.py), which rotation of the shared file cannot erase;
        `since`: a `denials_mark`, for those written after it (one exec's)."""
        return denials_of(without_probe_events(read_task_events(self.task_events_dir,
                                                                task_id, since)))

    def denials_mark(self, task_id: str) -> int:
        """Where the task's store ends now (an exec reads only what follows: a long
        session's earlier events are not parsed again for every exec)."""
        return store_size(self.task_events_dir, task_id)

    def end_accounting(self, rec: SandboxRecord) -> dict[str, Any]:
        """Bypass counts and every component's event totals for the end event (`rec`: the
        record this caller's teardown removed); the launcher's own summaries and totals
        are written first. The logged count is this process's reader's tally when it
        holds the NFLOG group (it read every sandbox's records), else what the task's
        store holds (another launcher's reader, or a dead run's, wrote them), once that
        reader has written its summaries and totals of the sandbox."""
        own = rec.owner_pid == os.getpid() and rec.owner_alive()
        logged = self.logged.pop(rec.task_id, 0)
        if not self.bound:  # another process's reader (the service) wrote them
            # the reader ends the task's tally when it sees the record gone
            # (end_tasks_gone_elsewhere): wait for it, so the end event counts it too
            stored = await_reader_totals(functools.partial(
                read_task_events, self.task_events_dir, rec.task_id))
            logged = max(logged, logged_in_store(stored))
        total = rec.bypass
        if self.bound or not own:  # else another launcher's reader reported them
            ev = unlogged_bypass_summary(
                rec.task_id, rec.profile, total, logged, rec.started_at, time.time())
            if ev is not None:
                self.events.write(ev)
        self.events.end_task(rec.task_id)
        self.ending.discard(rec.task_id)
        stored = read_task_events(self.task_events_dir, rec.task_id)
        return end_accounting(stored, max(total, logged), logged)
