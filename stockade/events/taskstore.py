"""The per-task event store: `<dir>/<task_id>.jsonl`, one file per task, never rotated.

Every component's writer appends each event that carries a task id there as well as to
the shared (rotating) events file, so a run's denials survive any amount of rotation:
the launcher reads a task's events from here, not from the shared file. Each writer
stores at most `max_bytes` per task (the throttle in summary.py keeps a task's verbatim
events under its budget, so this only caps a pathological flood of summaries); what it
could not store is counted and reported in the task's `event_totals` event
(`stockade.totals.store_truncated`), which is always stored. Files are removed by
`sweep` once older than the retention period.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

Event = dict[str, Any]

# a task id that is safe as a file name (the launcher's ids are 12 hex digits)
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@functools.lru_cache(maxsize=4096)  # asked for every event a writer stores
def task_file(directory: Path, task_id: str) -> Path | None:
    """The task's store file, or None for an id that cannot be a file name."""
    if not _SAFE.fullmatch(task_id):  # `$` alone would let a trailing newline in
        return None
    return directory / f"{task_id}.jsonl"


def append_line(fd: int, data: bytes) -> None:
    """Write one whole line with one write(2) on an O_APPEND descriptor, or nothing.

    A short write (a full disk) is cut off again, so the next line does not merge with a
    torn fragment; either way OSError is raised and the caller counts the event as lost.
    Several processes append to the same files (the shared events file, a task's store),
    so the write and the cut-back hold an flock: no other writer's line can land between
    them and be cut off with the fragment (two syscalls more per line).
    """
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        n = os.write(fd, data)
        if n == len(data):
            return
        end = os.lseek(fd, 0, os.SEEK_CUR)
        try:
            if os.fstat(fd).st_size == end:  # a writer that does not lock may have appended
                os.ftruncate(fd, end - n)
        except OSError:
            pass
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    raise OSError(errno.ENOSPC, f"short write ({n} of {len(data)} bytes)")


def append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        append_line(fd, data)
    finally:
        os.close(fd)


class OpenStores:
    """Open O_APPEND descriptors of task stores, so an event costs its store one locked
    write instead of an open, the write and a close (four syscalls fewer per event on
    the gateway's per-connection path). At most `keep` stay open (the oldest is closed
    first: a gateway's descriptors are its tunnels' budget), a task's is closed at its
    end, and every descriptor is checked at most every `check_s` (one fstat): a file
    that `sweep` (or anyone) unlinked meanwhile is reopened, so at most `check_s` of its
    lines go to a file nobody can read (sweep unlinks only stores idle for its retention)."""

    def __init__(self, keep: int = 64, check_s: float = 0.5) -> None:
        self.keep = keep
        self.check_s = check_s
        self._fds: dict[Path, tuple[int, float]] = {}  # path -> (fd, last checked)

    def append(self, path: Path, data: bytes) -> None:
        """`append(path, data)` through a kept descriptor; OSError as append's."""
        fd = self._fd(path)
        try:
            append_line(fd, data)
        except OSError:
            self.close(path)  # a fresh descriptor next time
            raise

    def _fd(self, path: Path) -> int:
        now = time.monotonic()
        kept = self._fds.get(path)
        if kept is not None:
            fd, checked = kept
            if now - checked < self.check_s:
                return fd
            try:
                if os.fstat(fd).st_nlink > 0:
                    self._fds[path] = (fd, now)
                    return fd
            except OSError:
                pass
            self.close(path)
        if len(self._fds) >= self.keep:
            self.close(next(iter(self._fds)))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        self._fds[path] = (fd, now)
        return fd

    def close(self, path: Path | None = None) -> None:
        """Close the descriptor of `path` (None: all of them)."""
        for p in list(self._fds) if path is None else [path]:
            kept = self._fds.pop(p, None)
            if kept is not None:
                with contextlib.suppress(OSError):
                    os.close(kept[0])


def store_size(directory: Path, task_id: str) -> int:
    """How many bytes the task's store holds now: a mark for `read_task_events(start=)`
    (the file only grows while the task runs)."""
    path = task_file(directory, task_id)
    try:
        return 0 if path is None else path.stat().st_size
    except OSError:
        return 0


def read_task_events(directory: Path, task_id: str, start: int = 0) -> list[Event]:
    """Every event stored for the task (all components), in file order; with `start` (a
    `store_size` mark) only those written after it, without parsing the earlier ones."""
    path = task_file(directory, task_id)
    out: list[Event] = []
    if path is None:
        return out
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError:
        return out
    with fh:
        if start > 0:
            fh.seek(start - 1)
            if fh.read(1) != b"\n":  # a mark inside a line: from the next whole one
                fh.readline()
        for line in fh:
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line another writer is still writing
            if isinstance(ev, dict):
                out.append(ev)
    return out


def sweep(directory: Path, retention_s: float, now: float | None = None) -> list[str]:
    """Remove task files not written for `retention_s`; returns the task ids removed."""
    t = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for e in entries:
        if not e.name.endswith(".jsonl"):
            continue
        try:
            if t - e.stat().st_mtime >= retention_s:
                os.unlink(e.path)
                removed.append(e.name[: -len(".jsonl")])
        except OSError:
            continue
    return removed
