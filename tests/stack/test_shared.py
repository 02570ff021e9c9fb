"""The shared stack's lock, leases and state (stack.shared): a crashed run's lease is free
at the next count, a zombie owner counts as gone, the state file is private and atomic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stockade.config import Config
from stockade.stack.services import StackError, ensure_stack
from stockade.stack.shared import (
    Lease,
    StackState,
    clear_state,
    live_leases,
    owner_alive,
    read_state,
    stack_lock,
    write_state,
)

HOLD = """
import sys, time
from pathlib import Path
from stockade.stack.shared import Lease
lease = Lease(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""


def test_leases_count_holders_and_sweep_crashed_ones(tmp_path: Path) -> None:
    assert live_leases(tmp_path) == 0
    mine = Lease(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        assert live_leases(tmp_path) == 2
        child.send_signal(signal.SIGKILL)  # a run that crashed never releases its lease
        child.wait()
        assert live_leases(tmp_path) == 1
        assert len(list((tmp_path / "leases").glob("*.lease"))) == 1  # swept
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    mine.release()
    mine.release()  # twice is harmless
    assert live_leases(tmp_path) == 0


def test_the_lock_excludes_another_process(tmp_path: Path) -> None:
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
             "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)")
    with stack_lock(tmp_path):
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "stack.lock")],
                              capture_output=True, text=True, check=False)
        assert held.returncode != 0 and "BlockingIOError" in held.stderr
    free = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "stack.lock")],
                          capture_output=True, text=True, check=False)
    assert free.returncode == 0, free.stderr


def test_state_round_trip_is_private_and_owned(tmp_path: Path) -> None:
    state = StackState(owner_pid=os.getpid(), kind="shared", config_file="/c.yaml",
                       request_file="/r.yaml", dev_vault=True)
    write_state(tmp_path, state)
    assert read_state(tmp_path) == state
    assert (tmp_path / "stack.json").stat().st_mode & 0o777 == 0o600
    clear_state(tmp_path, os.getpid() + 1)  # not this owner's: kept
    assert read_state(tmp_path) == state
    clear_state(tmp_path, os.getpid())
    assert read_state(tmp_path) is None


def test_a_zombie_owner_is_gone(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while owner_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # exited, not reaped yet: a zombie
    assert not owner_alive(child.pid)
    child.wait()
    assert owner_alive(os.getpid())


def test_a_corrupt_state_file_is_an_error_not_a_guess(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text("{not json")
    try:
        read_state(tmp_path)
    except OSError as e:
        assert "unreadable stack state" in str(e)
    else:
        raise AssertionError("a corrupt state file was accepted")


def test_an_unusable_run_dir_is_a_clear_error(tmp_path: Path) -> None:

    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = Config(run_dir=str(blocker / "run"))  # under a regular file: cannot be made
    with pytest.raises(StackError, match="cannot start or join the stack in"), ensure_stack(cfg):
        raise AssertionError("joined a stack in an unusable run_dir")
