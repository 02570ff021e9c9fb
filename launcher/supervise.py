"""A running sandbox watched to its end: output captures, the stdin feeder, the pidfd wait
with its kill/TTL/limit checks, and the pure rules that name how it ended."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # annotations only
    from . import cgroups
    from .spec import EndedBy


class Capture(threading.Thread):
    """Drains one pipe; keeps the first `cap` bytes, discards the rest (never blocks the child)."""

    def __init__(self, stream: IO[bytes], cap: int) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.cap = cap
        self.buf = bytearray()
        self.truncated = False
        self.total = 0  # every byte the command wrote, kept or not

    def run(self) -> None:
        while True:
            chunk = self.stream.read1(65536) if hasattr(self.stream, "read1") else b""
            if not chunk:
                break
            self.total += len(chunk)
            room = self.cap - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            if len(chunk) > max(room, 0):
                self.truncated = True
        self.stream.close()

    def text(self) -> str:
        return bytes(self.buf).decode("utf-8", "replace")


def started(stream: IO[bytes], cap: int) -> Capture:
    c = Capture(stream, cap)
    c.start()
    return c


class Ended(NamedTuple):
    """What a backend's wait saw, before the shared rules of `classify_end`."""

    ended_by: EndedBy  # exit, or what the watch loop killed it for
    exit_code: int
    limit_hit: bool  # the sandbox itself reported a limit (guest OOM / pids), or its pids
    out: Capture
    err: Capture
    failed: str | None = None  # why the sandbox could not run its command (microVM)


def feed(stream: IO[bytes], data: bytes) -> None:
    with contextlib.suppress(OSError):
        stream.write(data)
    with contextlib.suppress(OSError):
        stream.close()


def feed_stdin(proc: subprocess.Popen[bytes], data: bytes | None) -> None:
    if proc.stdin is not None:
        # fed from a thread: a command that never reads must not stall the TTL
        threading.Thread(target=feed, args=(proc.stdin, data or b""), daemon=True).start()


def kill_proc(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def kill_marker(scratch: str) -> Path:
    """The file a kill from another launcher process leaves for the sandbox's owner."""
    return Path(scratch) / "killed"


def watch(proc: subprocess.Popen[bytes], cg: cgroups.CgroupSet, killed: threading.Event,
          deadline: float, over_limit: Callable[[], bool] | None = None) -> EndedBy:
    """Wait for the sandbox's outermost process; SIGKILL everything in it on a kill, at the
    deadline, or when `over_limit` says so. Returns why it ended."""
    ended_by: EndedBy = "exit"
    # a pidfd wakes the loop the moment the sandbox ends (no polling delay)
    pidfd = os.pidfd_open(proc.pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while True:
        if poller.poll(50) and proc.poll() is not None:
            break
        if proc.poll() is not None:
            break
        if killed.is_set():  # also when kill() came before the process existed
            ended_by = "killed"
        elif time.monotonic() >= deadline:
            ended_by = "ttl"
        elif over_limit is not None and over_limit():
            ended_by = "limit"
        else:
            continue
        cg.kill_all()
        kill_proc(proc)
    os.close(pidfd)
    # the namespace's init is gone: every process in it is gone with it
    cg.kill_all()
    return ended_by


def exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def classify_end(ended_by: EndedBy, exit_code: int, killed: bool,
                 limit: Callable[[], bool]) -> tuple[EndedBy, int]:
    """(ended_by, exit code) as reported (pure). `killed`: an operator's kill, here or
    from another process; `limit`: the sandbox hit a limit (asked only for a plain exit)."""
    we_killed = ended_by != "exit"  # the watch SIGKILLed it (kill, ttl, pids)
    if killed:
        ended_by = "killed"
        we_killed = True
    if we_killed:
        # util-linux unshare, seeing its child die of SIGKILL before its own SIGKILL
        # lands, cannot re-raise it (signal(SIGKILL) is EINVAL) and exits 1:
        # report what really happened
        return ended_by, 128 + signal.SIGKILL
    if ended_by == "exit" and limit():
        return "limit", exit_code  # OOM kill, pids limit, or a failure on a full scratch
    return ended_by, exit_code


def capture_fields(out: Capture | None, err: Capture | None) -> dict[str, Any]:
    """RunResult's truncation fields of the two streams' captures."""
    return {"stdout_truncated": bool(out and out.truncated),
            "stderr_truncated": bool(err and err.truncated),
            "stdout_bytes": out.total if out else 0, "stderr_bytes": err.total if err else 0}
