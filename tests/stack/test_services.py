"""A stack's child dies with its owner even when the owner is SIGKILLed (never runs stop()):
an orphaned gateway would keep the ports and sockets the next stack needs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from polling import eventually

from stockade.stack.services import Service
from stockade.stack.shared import owner_alive

OWNER = """
import sys, time
from stockade.stack.services import Service
svc = Service("gateway", ["sleep", "300"], "/nonexistent.sock", None)
svc.start()
print(svc.proc.pid, flush=True)
time.sleep(300)
"""


def test_a_service_dies_with_its_sigkilled_owner() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        assert owner_alive(child)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        eventually(lambda: not owner_alive(child), 30)
        assert not owner_alive(child), "the service outlived its owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if child and owner_alive(child):
            os.kill(child, signal.SIGKILL)


def test_start_returns_once_the_death_guard_holds() -> None:
    """setpriv sets PDEATHSIG and then execs the program: a start that returned before
    would leave a window in which a SIGKILLed owner orphans its child for good."""
    svc = Service("gateway", ["sleep", "300"], Path("/nonexistent.sock"), None)
    svc.start()
    try:
        assert svc.proc is not None
        assert os.readlink(f"/proc/{svc.proc.pid}/exe") == os.path.realpath(
            shutil.which("sleep") or "sleep")
    finally:
        svc.stop(timeout=1.0)
