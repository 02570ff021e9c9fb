"""A CPU hog on one core, for the benches' `--hog` runs: how a component behaves on a
sandbox node whose other core is busy (another sandbox's build, a test suite).

The hog is a child process pinned to one CPU that spins in an empty loop (no
syscalls, no memory traffic) at normal priority, so it competes for that
core's time slices exactly as a CPU-bound neighbour does. Nothing else is pinned: the
scheduler still places the proxy, the upstream and the client where it likes, and so
they get about one core between them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def other_core() -> int:
    """The highest-numbered CPU this process may run on (CPU 1 on the 2-core host)."""
    return max(os.sched_getaffinity(0))


def describe(cpu: int | None) -> str:
    return "no CPU hog" if cpu is None else f"a CPU hog spinning on CPU {cpu}"


@contextlib.contextmanager
def running(cpu: int | None) -> Iterator[int | None]:
    """A hog on `cpu` while the block runs (None: no hog); yields `cpu`."""
    if cpu is None:
        yield None
        return
    if cpu not in os.sched_getaffinity(0):
        raise ValueError(
            f"CPU {cpu} is not available here (allowed: {sorted(os.sched_getaffinity(0))})"
        )
    proc = subprocess.Popen([sys.executable, "-c", SPIN, str(cpu)])
    try:
        yield cpu
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
