"""What `stockade run` tells a person at the terminal on stderr: which long phase it is
in (the stack starting, the sandbox being set up, a microVM's guest booting), and at the
end a short summary of what the fence denied, counted by reason and destination.
Nothing here changes `--json` output: that mode prints no progress at all."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from stockade.client.denials import denial_summary

PREFIX = "stockade run: "


class Progress:
    """Lines on `out` (stderr), each whole: the launcher's events arrive from the run's
    threads, so writes are serialised."""

    def __init__(self, out: TextIO | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out  # None: quiet
        self._clock = clock
        self._lock = threading.Lock()
        self._since = clock()

    def say(self, text: str) -> None:
        if self._out is None:
            return
        with self._lock:
            self._out.write(PREFIX + text + "\n")
            self._out.flush()

    @contextmanager
    def phase(self, doing: str, done: str) -> Iterator[None]:
        """`doing…` now, `done (N.N s)` once the block has ended without an error."""
        self.say(doing + "…")
        t0 = self._clock()
        yield
        self.say(f"{done} ({self._clock() - t0:.1f} s)")

    def begin_sandbox(self) -> None:
        self._since = self._clock()

    def on_event(self, ev: dict[str, Any]) -> None:
        """The launcher's start event: the sandbox exists; a microVM now boots its guest."""
        st = ev.get("stockade") if isinstance(ev.get("stockade"), dict) else {}
        if ev.get("event", {}).get("action") != "sandbox_lifecycle" or st.get("lifecycle") \
                != "start":
            return
        task = ev.get("labels", {}).get("task_id", "?")
        tier = st.get("isolation", "?")
        then = ("booting the guest and running the command" if tier == "microvm"
                else "running the command")
        self.say(f"sandbox {task} ready at {tier} grade "
                 f"({self._clock() - self._since:.1f} s); {then}")

    def summary(self, denials: list[dict[str, Any]]) -> None:
        for line in denial_summary(denials):
            self.say(line)
