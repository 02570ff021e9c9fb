"""Whole lines of the events file; with follow, every line once, across rotations.

The writers rotate by rename (events.jsonl -> .1 -> .2 ... -> .backups, the oldest
deleted) and several writers share the file: a writer that did not rotate keeps appending
to the renamed file until it notices, up to ROTATION_CHECK_S later. So at a rotation the
reader (1) drains its old handle, (2) reads from the start every file that is newer than
its old one (with two rotations in one poll, .1 holds lines it never saw), found by inode
among path.1, path.2, ..., and (3) keeps reading the renamed files until they have been
idle for 2 x ROTATION_CHECK_S. Open handles pin their inodes, so an inode compared here
is never one the file system has handed to a new file.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .writer import ROTATION_CHECK_S

DRAIN_IDLE_S = 2 * ROTATION_CHECK_S
# renamed files kept draining at most; past it the longest idle closes first (a writer
# rotating many times a second would otherwise use up the file descriptors)
MAX_DRAINING = 64


@dataclass
class _Handle:
    fh: BinaryIO
    ino: int
    last_data: float
    buf: bytes = b""  # a partial line, per handle: two files never mix their halves

    def read_lines(self, now: float) -> list[str]:
        data = self.fh.read()
        if not data:
            return []
        self.last_data = now
        *whole, self.buf = (self.buf + data).split(b"\n")
        # a damaged byte must not stop the view; the JSON parse skips such a line
        return [w.decode("utf-8", "replace") + "\n" for w in whole]

    def close(self) -> None:
        self.fh.close()


def _open(path: Path, now: float) -> _Handle | None:
    try:
        fh = open(path, "rb")  # noqa: SIM115 - kept open while following
    except FileNotFoundError:
        return None
    return _Handle(fh, os.fstat(fh.fileno()).st_ino, now)


def _ino(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class _Tail:
    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        self.path = path
        self.clock = clock
        self.current: _Handle | None = None
        self.draining: list[_Handle] = []  # renamed files other writers may still append to
        self._backup_name = re.compile(re.escape(path.name) + r"\.(\d+)")

    def open_current(self) -> bool:
        self.current = _open(self.path, self.clock())
        return self.current is not None

    def read_draining(self) -> list[str]:
        now = self.clock()
        out: list[str] = []
        for h in list(self.draining):
            out += h.read_lines(now)
            if now - h.last_data > DRAIN_IDLE_S:
                h.close()
                self.draining.remove(h)
        if len(self.draining) > MAX_DRAINING:
            self.draining.sort(key=lambda h: h.last_data)
            for h in self.draining[:-MAX_DRAINING]:
                h.close()
            del self.draining[:-MAX_DRAINING]
        return out

    def check_rotation(self) -> list[str]:
        """After a rotation: the rest of the old file, then every newer rotated file from
        its start, oldest first; the new file is read by the caller's next round."""
        cur = self.current
        assert cur is not None
        if _ino(self.path) in (None, cur.ino):  # None: mid-rotation, the new file comes later
            return []
        now = self.clock()
        out = cur.read_lines(now)
        new = _open(self.path, now)
        if new is None:
            return out
        pinned = {h.ino for h in self.draining}
        for h in self._between(cur, new, pinned):
            out += h.read_lines(now)
            self.draining.append(h)
        cur.last_data = now  # idle time counts from the rotation
        self.draining.append(cur)
        self.current = new
        return out

    def _between(self, old: _Handle, new: _Handle, pinned: set[int]) -> list[_Handle]:
        """The rotated files newer than `old` and older than `new`, oldest first. They are
        opened upward (.1, .2, ...): a rotation running meanwhile moves files up, so going
        up meets each file at least once (a second meeting is dropped by inode) and never
        skips one. If `new` itself was rotated meanwhile, the files above it in the list
        are newer still: the next check finds them, as the path has moved on from `new`."""
        found = self._backups()
        inos = [h.ino for h in found]
        if old.ino in inos:
            at = inos.index(old.ino)
        else:
            # not among the backups: deleted (rotated past .backups), so every backup is
            # newer; or moved away by someone else, so none of them follows it
            at = len(found) if os.fstat(old.fh.fileno()).st_nlink == 0 else 0
        start = inos.index(new.ino) + 1 if new.ino in inos[:at] else 0
        keep = [h for h in found[start:at] if h.ino not in pinned]
        for h in found:
            if h not in keep:
                h.close()
        return keep[::-1]

    def _backups(self) -> list[_Handle]:
        try:
            names = os.listdir(self.path.parent)
        except FileNotFoundError:
            return []
        nums = [int(m.group(1)) for n in names if (m := self._backup_name.fullmatch(n))]
        top = max(nums, default=0) + 2  # a rotation may move the last one up meanwhile
        now = self.clock()
        out: list[_Handle] = []
        seen: set[int] = set()
        for i in range(1, top + 1):
            h = _open(self.path.with_name(f"{self.path.name}.{i}"), now)
            if h is None:
                continue  # a hole while a rotation moves files up
            if h.ino in seen:
                h.close()
                continue
            seen.add(h.ino)
            out.append(h)
        return out

    def close(self) -> None:
        for h in [self.current, *self.draining]:
            if h is not None:
                h.close()
        self.current = None
        self.draining.clear()


def lines(
    path: Path,
    follow: bool,
    poll: float = 0.25,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[str]:
    """Whole lines of `path` (a torn last line waits for its end); with follow, keeps
    reading across rotations and never yields a line twice or skips one that was still
    on disk. `sleep` and `clock` are injectable so tests can rotate between two polls."""
    tail = _Tail(path, clock)
    try:
        while True:
            if tail.current is None and not tail.open_current():
                if not follow:
                    return
                sleep(poll)
                continue
            assert tail.current is not None
            yield from tail.current.read_lines(clock())
            if not follow:
                return
            yield from tail.read_draining()
            sleep(poll)  # at end of file: wait for more, or for a rotation
            yield from tail.check_rotation()
    finally:
        tail.close()
