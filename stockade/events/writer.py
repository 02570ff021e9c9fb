"""JSON-lines event sink: one line per event, flushed per event, size-based rotation.

Nothing is dropped silently: an event that cannot be written (disk full, permissions,
an unserialisable value) increments `dropped`, which metrics export.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

Event = dict[str, Any]


class EventWriter:
    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        max_bytes: int = 50 * 2**20,
        backups: int = 5,
        stdout: bool = False,
        keep_recent: int = 0,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.max_bytes = max_bytes
        self.backups = backups
        self.stdout = stdout
        self.written = 0
        self.dropped = 0
        self.recent: deque[Event] = deque(maxlen=keep_recent)  # 0 keeps nothing
        self._lock = threading.Lock()
        self._fh: TextIO | None = None
        self._ino = 0
        self._size = 0  # current file size, as seen at the last write (several writers share it)
        self._subscribers: list[Callable[[Event], None]] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def subscribe(self, fn: Callable[[Event], None]) -> None:
        """Call `fn` with every event written (metrics, tests, live views)."""
        self._subscribers.append(fn)

    def _open(self) -> TextIO:
        """The open file, reopened when another process (gateway, broker) rotated it away."""
        assert self.path is not None
        if self._fh is not None:
            try:
                st = os.stat(self.path)
                if st.st_ino == self._ino:
                    self._size = st.st_size
                    return self._fh
            except FileNotFoundError:
                pass
            self._fh.close()
            self._fh = None
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        st = os.fstat(self._fh.fileno())
        self._ino = st.st_ino
        self._size = st.st_size
        return self._fh

    def _rotate(self) -> None:
        assert self.path is not None
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.backups > 0:
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)

    def write(self, event: Event) -> bool:
        try:
            line = json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n"
        except (TypeError, ValueError):
            self.dropped += 1
            return False
        ok = True
        with self._lock:
            if self.path is not None:
                try:
                    fh = self._open()
                    if self._size and self._size + len(line) > self.max_bytes:
                        self._rotate()
                        fh = self._open()
                    fh.write(line)  # one write(2) per line in O_APPEND mode: lines never interleave
                    fh.flush()
                except OSError:
                    self.dropped += 1
                    ok = False
                    self._fh = None
            if self.stdout:
                try:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                except (OSError, ValueError):
                    self.dropped += 1
                    ok = False
            if ok:
                self.written += 1
            if self.recent.maxlen:
                self.recent.append(event)
        for fn in self._subscribers:
            try:
                fn(event)
            except Exception:  # a broken subscriber must not lose the event for others
                self.dropped += 1
        return ok

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


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
