"""JSON-lines event sink: one line per event, flushed per event, size-based rotation.

Nothing is dropped silently: an event that cannot be written (disk full, permissions,
an unserialisable value) increments `dropped`, which metrics export; the first loss and
every LOST_LOG_EVERY-th is logged, and once writing works again an `events_lost` event
says how many were lost. A line is written whole or not at all (taskstore.append_line).

With a `throttle` (summary.py) a task's denials past the first few per key, and all its
events past its budget, become summary events; with a `task_dir` every event that
carries a task id is also appended to that task's store (taskstore.py). With a `chain`
(chain.py) every line gets an id, a sequence number and the previous line's digest, and
signed checkpoints follow at intervals.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from . import taskstore
from .build import make_event
from .chain import ChainSigner
from .summary import LOST_ACTION, EventHead, EventThrottle, ThrottleSettings, task_of

Event = dict[str, Any]

# orjson writes key order, non-ASCII text (as UTF-8), ints and strings as json.dumps(...,
# separators=(",", ":"), ensure_ascii=False) does, about ten times faster (the events are
# on the gateway's per-connection and the broker's per-call path). Floats parse to the
# same number, but below 1e-4 are spelled without an exponent (0.00001, not 1e-05); NaN
# and infinities, which json.dumps wrote as non-JSON tokens, become null. Dataclasses and
# datetimes, which orjson would serialise itself, go to the stdlib fallback below, which
# refuses them as before (counted in `dropped`).
_ORJSON_OPTS = (
    orjson.OPT_APPEND_NEWLINE | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
)


def encode_line(event: Event) -> bytes:
    """One event as one JSON line (UTF-8, compact, newline-terminated).

    Raises TypeError or ValueError when the event cannot be written as JSON.
    """
    try:
        return orjson.dumps(event, option=_ORJSON_OPTS)
    except TypeError:
        # what orjson refuses but json.dumps wrote (non-str keys, ints beyond 64 bits,
        # float subclasses) keeps its old form; the rest fails here as it did before
        line = json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n"
        return line.encode("utf-8")

ROTATION_CHECK_S = 0.5  # how often a writer looks for a rotation done by another process
SUMMARY_FLUSH_S = 1.0  # how often a component writes the summaries of ended windows
LOST_LOG_EVERY = 1000  # a log line at the first lost event and then every this many
TASK_STORE_BYTES = 4 * 2**20  # default cap per task and writer in the per-task store
LABELLED_TASKS = 8192  # tasks whose labels a writer remembers (oldest forgotten first)
log = logging.getLogger("stockade.events")


class EventWriter:
    # event -> one JSON line (bytes); a class attribute so bench/events_bench.py can time
    # this same write path with the encoder it replaced
    encode: Callable[[Event], bytes] = staticmethod(encode_line)

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        max_bytes: int = 50 * 2**20,
        backups: int = 5,
        stdout: bool = False,
        keep_recent: int = 0,
        throttle: ThrottleSettings | None = None,
        task_dir: str | os.PathLike[str] | None = None,
        task_store_bytes: int = TASK_STORE_BYTES,
        chain: ChainSigner | None = None,
        encode: Callable[[Event], bytes] | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.max_bytes = max_bytes
        self.backups = backups
        self.stdout = stdout
        self.written = 0
        self.dropped = 0
        self.summarised = 0  # events counted into a summary instead of written
        self.throttle = EventThrottle(throttle) if throttle is not None else None
        self.task_dir = Path(task_dir) if task_dir is not None else None
        self.task_store_bytes = task_store_bytes
        self.chain = chain
        if encode is not None:  # another line format (events.format: ocsf); chained the same
            self.encode = encode
        # task id -> [bytes stored, events not stored]; bounded like the throttle's tasks
        self._stored: dict[str, list[int]] = {}
        self._stores = taskstore.OpenStores()
        self._lost = 0  # events lost since the last `events_lost` event
        self._lost_component = "gateway"
        self.recent: deque[Event] = deque(maxlen=keep_recent)  # 0 keeps nothing
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._checked = 0.0
        self._ino = 0
        self._size = 0  # current file size, as seen at the last write (several writers share it)
        self._subscribers: list[Callable[[Event], None]] = []
        self._labels_of: Callable[[str], dict[str, str] | None] | None = None
        # task id -> its labels, from the first event until end_task (a task's last
        # events come after its deregistration: they are labelled all the same)
        self._labels: dict[str, dict[str, str]] = {}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.task_dir is not None:
            self.task_dir.mkdir(parents=True, exist_ok=True)

    def label_with(self, labels_of: Callable[[str], dict[str, str] | None]) -> None:
        """Copy each task's labels (`labels_of(task_id)`, the task registry's) into every
        event of the task, beside `labels.task_id` and `labels.profile`."""
        self._labels_of = labels_of

    def _label(self, event: Event) -> None:
        own = event.get("labels")
        tid = own.get("task_id") if isinstance(own, dict) else None
        if not isinstance(tid, str) or self._labels_of is None:
            return
        extra = self._task_labels(tid, self._labels_of)
        if extra:
            event["labels"] = {**extra, **own}  # type: ignore[dict-item]

    def _task_labels(self, tid: str, labels_of: Callable[[str], dict[str, str] | None]
                     ) -> dict[str, str]:
        extra = self._labels.get(tid)
        if extra is None:
            extra = labels_of(tid) or {}
            if extra:
                if len(self._labels) >= LABELLED_TASKS:
                    self._labels.pop(next(iter(self._labels)))
                self._labels[tid] = extra
        return extra

    def subscribe(self, fn: Callable[[Event], None]) -> None:
        """Call `fn` with every event written (metrics, tests, live views)."""
        self._subscribers.append(fn)

    def _open(self) -> int:
        """The open descriptor, reopened when another process (gateway, broker) rotated the
        file away; that is checked at most every ROTATION_CHECK_S, and events written in
        between land in the rotated file, not nowhere."""
        assert self.path is not None
        now = time.monotonic()
        if self._fd is not None:
            if now - self._checked < ROTATION_CHECK_S:
                return self._fd
            self._checked = now
            try:
                st = os.stat(self.path)
                if st.st_ino == self._ino:
                    self._size = st.st_size
                    return self._fd
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        st = os.fstat(self._fd)
        self._ino = st.st_ino
        self._size = st.st_size
        self._checked = now
        return self._fd

    def _rotate(self) -> None:
        """Shift the backups and move the full file to `.1`, under the file's own flock:
        several processes share it, and one that finds another has just rotated it (the
        path names another file now) leaves it, instead of renaming a backup that moved
        under it (an event lost) or rotating twice."""
        assert self.path is not None and self._fd is not None
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # writers hold it per line (append_line)
            try:
                if os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                    return
            except FileNotFoundError:
                return
            path = self.path

            def backup(i: int) -> Path:
                return path.with_name(f"{path.name}.{i}")

            for i in range(self.backups - 1, 0, -1):
                with contextlib.suppress(FileNotFoundError):  # not there (yet): nothing to shift
                    backup(i).replace(backup(i + 1))
            if self.backups > 0:
                self.path.replace(backup(1))
            else:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # the lock goes with it

    def write(self, event: Event) -> bool:
        """Write (or, under a throttle, maybe only count) one event; False when lost."""
        if self._labels_of is not None:
            self._label(event)
        try:
            data = self.encode(event)
        except (TypeError, ValueError):  # ValueError includes a lone surrogate's encode error
            with self._lock:
                self._lose(event)
            return False
        now = time.time()
        done: list[Event] = []
        with self._lock:
            verbatim = True
            if self.throttle is not None:
                verbatim = self.throttle.offer(event, len(data), now)
                for ev in self.throttle.due(now):
                    self._write_locked(ev, None, done)
            if verbatim:
                ok = self._write_locked(event, data, done)
            else:
                self.summarised += 1
                ok = True
        self._notify(done)
        return ok

    def counts(self, head: EventHead) -> bool:
        """True: the throttle only counts the event `head` heads, and has counted it
        (EventThrottle.counts), so the caller need not build it; False: build it and
        `write` it. For the events a component emits in great numbers (the gateway's)."""
        if self.throttle is None:
            return False
        now = time.time()
        done: list[Event] = []
        with self._lock:
            if not self.throttle.counts(head, now):
                return False
            self.summarised += 1
            if self._labels_of is not None and head.task_id is not None:
                # as write() would have: a task's labels are kept from its first event
                self._task_labels(head.task_id, self._labels_of)
            for ev in self.throttle.due(now):
                self._write_locked(ev, None, done)
        self._notify(done)
        return True

    def tally(self, event: Event) -> None:
        """Count an event its component chose not to write (see EventThrottle.tally)."""
        if self.throttle is None:
            return
        with self._lock:
            self.throttle.tally(event, time.time())
            self.summarised += 1

    def flush_due(self, now: float | None = None) -> None:
        """Write the summaries of windows that have ended. `write` does it with the next
        event; the components also call this periodically, so a quiet task's counts are
        on disk a window after they happened, not only at its end (a SIGKILL loses at
        most the counts of windows still open)."""
        done: list[Event] = []
        with self._lock:
            if self.throttle is not None:
                for ev in self.throttle.due(time.time() if now is None else now):
                    self._write_locked(ev, None, done)
            # a quiet stream's tail gets its checkpoint here, not only with the next event
            self._checkpoint_if_due(done)
        self._notify(done)

    def end_task(self, task_id: str) -> list[Event]:
        """The task is gone: write its pending summaries and totals; returns the totals."""
        done: list[Event] = []
        with self._lock:
            stored = self._stored.pop(task_id, None)
            events = self.throttle.end_task(task_id, time.time()) if self.throttle else []
            for ev in events:
                if stored and stored[1] and ev["event"]["action"] == "event_totals":
                    ev["stockade"]["totals"]["store_truncated"] = stored[1]
                self._write_locked(ev, None, done)
            self._labels.pop(task_id, None)
            path = taskstore.task_file(self.task_dir, task_id) if self.task_dir else None
            if path is not None:
                self._stores.close(path)  # its last lines are in: no descriptor kept
        self._notify(done)
        return [e for e in events if e["event"]["action"] == "event_totals"]

    def _notify(self, events: list[Event]) -> None:
        for event in events:
            for fn in self._subscribers:
                try:
                    fn(event)
                except Exception:  # a broken subscriber must not lose the event for others
                    self.dropped += 1

    def _lose(self, event: Event) -> None:
        self.dropped += 1
        self._lost += 1
        st = event.get("stockade")
        if isinstance(st, dict) and isinstance(st.get("component"), str):
            self._lost_component = st["component"]
        if self._lost == 1 or self.dropped % LOST_LOG_EVERY == 0:
            log.warning("events: %d event(s) could not be written to %s (%d lost so far)",
                        self._lost, self.path, self.dropped)

    def _write_locked(self, event: Event, data: bytes | None, done: list[Event]) -> bool:
        if data is None and self._labels_of is not None:  # a summary the throttle made
            self._label(event)
        if self._lost:
            self._report_loss(done)
        data = self._line(event, data)
        if data is None or not self._emit_line(data):
            self._lose(event)
            return False
        self.written += 1
        if self.recent.maxlen:
            self.recent.append(event)
        self._store(event, data)
        done.append(event)
        self._checkpoint_if_due(done)
        return True

    def _line(self, event: Event, data: bytes | None) -> bytes | None:
        """The event's line: stamped by the chain (encoded again, with its id, sequence
        and link) or `data` as pre-encoded; None when it cannot be encoded."""
        try:
            if self.chain is not None:
                return self.chain.stamp(event, self.encode)
            return self.encode(event) if data is None else data
        except (TypeError, ValueError):
            return None

    def _checkpoint_if_due(self, done: list[Event], now: float | None = None) -> None:
        if self.chain is None or not self.chain.due(now):
            return
        ev = self.chain.checkpoint_event()
        if self._emit_line(self.chain.stamp(ev, self.encode)):
            self.written += 1
            done.append(ev)
        # else the checkpoint is retried after the next line: it is still due

    def _report_loss(self, done: list[Event]) -> None:
        """An `events_lost` event, written before the next event once writing works."""
        lost = self._lost
        note = make_event(
            component=self._lost_component, action=LOST_ACTION,  # type: ignore[arg-type]
            message=f"{lost} event(s) could not be written (disk full or unwritable)",
            extra={"lost": lost, "lost_total": self.dropped})
        line = self._line(note, None)
        if line is not None and self._emit_line(line):
            self._lost = 0
            log.warning("events: writing works again; %d event(s) were lost", lost)
            done.append(note)

    def _emit_line(self, data: bytes) -> bool:
        """Write the line to the file and stdout; False when either failed. The chain
        advances once the file has it (a stdout failure must not reuse its sequence
        number: the line is in the file), or stdout when there is no file."""
        file_ok = self._emit_file(data) if self.path is not None else None
        stdout_ok = self._emit_stdout(data) if self.stdout else None
        if self.chain is not None and (file_ok or (file_ok is None and stdout_ok is not False)):
            self.chain.advance(data)
        return file_ok is not False and stdout_ok is not False

    def _emit_stdout(self, data: bytes) -> bool:
        try:
            sys.stdout.write(data.decode("utf-8"))
            sys.stdout.flush()
        except (OSError, ValueError):
            return False
        return True

    def _emit_file(self, data: bytes) -> bool:
        try:
            fd = self._open()
            if self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
                fd = self._open()
            # one write(2) per line in O_APPEND mode: lines of several writers
            # never interleave, and nothing waits in a user-space buffer
            taskstore.append_line(fd, data)
            self._size += len(data)
        except OSError:
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None
            return False
        return True

    def _store(self, event: Event, data: bytes) -> None:
        """Append to the task's store (within its cap; totals always go in)."""
        if self.task_dir is None:
            return
        task_id = task_of(event)
        path = taskstore.task_file(self.task_dir, task_id) if task_id else None
        if path is None or task_id is None:
            return
        row = self._stored.get(task_id)
        if row is None:
            if len(self._stored) >= 4096:  # bounded: forget the oldest task's count
                self._stored.pop(next(iter(self._stored)))
            row = self._stored[task_id] = [0, 0]
        if row[0] + len(data) > self.task_store_bytes and \
                event["event"].get("action") != "event_totals":
            row[1] += 1
            return
        try:
            self._stores.append(path, data)
            row[0] += len(data)
        except OSError:
            row[1] += 1

    def close(self) -> None:
        done: list[Event] = []
        with self._lock:
            if self.throttle is not None:
                for ev in self.throttle.flush_all(time.time()):
                    self._write_locked(ev, None, done)
            self._checkpoint_if_due(done, float("inf"))  # the tail is signed too
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._stores.close()
        self._notify(done)


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """Read a JSON-lines event file (tests, `stockade events`); skips torn last lines."""
    out: list[Event] = []
    p = Path(path)
    if not p.exists():
        return out
    with open(p, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
