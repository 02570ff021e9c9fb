"""One more command in a running session sandbox: what is asked (`ExecSpec`) and the
process-shaped handle every tier answers with (`ExecProc`).

The shape is `subprocess.Popen`'s on purpose: the container and gVisor tiers return a
Popen (nsenter / `runsc exec`), the microVM tier a handle over its guest agent's channel
with the same attributes, so the session code that streams, times out and kills an exec
is one piece for all three tiers.
"""

from __future__ import annotations

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
