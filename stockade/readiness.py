"""Readiness on a pipe, not by polling: whoever starts a service (the stack) makes a pipe,
hands the child its write end (named by STOCKADE_READY_FD) and waits on the read end.
The service writes one byte once it serves (stockade.serving); EOF without it means the
service ended first. The keeper says its stack is ready to the starting run the same way.
"""

from __future__ import annotations

import contextlib
import os

READY_FD_ENV = "STOCKADE_READY_FD"


def take_ready_fd() -> int | None:
    """This process's ready descriptor, taken out of the environment (a child this
    service starts must not believe it is its own)."""
    raw = os.environ.pop(READY_FD_ENV, None)
    return int(raw) if raw is not None and raw.isdigit() else None


def say_ready(fd: int | None) -> None:
    """One byte on `fd`, then close it (None: nobody waits)."""
    if fd is None:
        return
    with contextlib.suppress(OSError):  # the starter may have given up and gone
        os.write(fd, b"R")
    with contextlib.suppress(OSError):
        os.close(fd)
