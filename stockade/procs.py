"""Process helpers shared by the stack, the dev OpenBao, the launcher and the fake internet."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol


class ChildProcess(Protocol):
    """What the stack uses of a child: `subprocess.Popen`, or stack.prefork's `Forked`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...


def death_guard() -> list[str]:
    """argv prefix that makes a child get SIGTERM when the thread that started it ends,
    even when its owner is SIGKILLed and never runs its stop() (util-linux setpriv: prctl
    PDEATHSIG, then exec); empty where setpriv is missing."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


def popen_guarded(argv: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(argv, **popen)` behind the death guard, returned once the guard
    holds: setpriv execs the program right after its prctl, so its executable being
    another one means PDEATHSIG is set. Before that an owner killed at once would orphan
    the child for good (setpriv never checks that its parent is still there)."""
    guard = death_guard()
    proc: subprocess.Popen[bytes] = subprocess.Popen([*guard, *argv], **popen)
    if guard:
        _wait_exec(proc, os.path.realpath(guard[0]))
    return proc


def _wait_exec(proc: subprocess.Popen[bytes], guard: str, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < end:
        try:
            if os.readlink(f"/proc/{proc.pid}/exe") != guard:
                return
        except OSError:  # gone meanwhile (poll says so next)
            pass
        time.sleep(0.0005)  # setpriv's start: a few hundred microseconds


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists (EPERM means it exists, owned by another)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: ChildProcess | None, timeout: float = 10.0) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session=True), wait,
    then SIGKILL: a child never outlives its owner, grandchildren included."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22), or
    None when it is gone: with the pid, it names one process even after pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: int, started: int) -> bool:
    """True while `pid` is still the process that had start time `started` (0: unknown,
    then any process with that pid counts)."""
    if not pid_alive(pid):
        return False
    if not started:
        return True
    now = start_time(pid)
    return now is None or now == started  # None: exists but unreadable (EPERM): assume it
