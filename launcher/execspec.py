"""One more command in a running session sandbox: what is asked (`ExecSpec`) and the
process-shaped handle every tier answers with (`ExecProc`).

The shape is `subprocess.Popen`'s on purpose: the container and gVisor tiers return a
Popen (nsenter / `runsc exec`), the microVM tier a handle over its guest agent's channel
with the same attributes, so the session code that streams, times out and kills an exec
is one piece for all three tiers.
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from typing import IO, Protocol


@dataclass(frozen=True, slots=True)
class ExecSpec:
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # the whole environment, already checked
    cwd: str = "/scratch"  # absolute inside the sandbox, beneath its scratch
    stdin: bytes | None = None
    timeout_s: float | None = None


class ExecProc(Protocol):
    """A started exec: its pipes, its end, and a way to stop it."""

    pid: int
    stdin: IO[bytes] | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class EndedByReport:
    """`poll` and `wait` of an exec whose end is reported to the launcher (by the exec
    server's or the guest agent's reader thread) rather than waited for as a child: the
    reader sets `returncode`, then `_done`. The two handles that are not a Popen share it,
    so waiting on an exec means the same on every tier."""

    returncode: int | None
    _done: threading.Event
    pid: int

    def _init_report(self) -> None:
        self.returncode = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"exec {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _report_end(self, status: int) -> None:
        self.returncode = status
        self._done.set()
