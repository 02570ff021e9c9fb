"""One embedded stack shared by concurrent `stockade run`s on one run_dir.

Simultaneous runs used to each start a gateway and broker on the same ports and sockets
(`Address already in use`, `not ready after 60s`), and a run that had joined another's
stack lost it when that run ended. Now:

- `<run_dir>/stack.lock` (fcntl.flock) serialises every start, join and leave;
- the stack belongs to a detached keeper process (`stockade.stack.keeper`), not to the run
  that started it, so the dev OpenBao (which dies with the thread that started it) lives
  as long as the stack;
- each run holds a lease: a file under `<run_dir>/leases/` it keeps flock'ed, so a crashed
  run's lease is free (and swept) at the next count;
- the last run out (no live lease left) stops the keeper and waits, under the lock, until
  the stack is gone, so the next run starts a fresh one instead of joining a dying one.

`stockade up` records itself in the same state file (`stack.json`) so runs can find its dev
OpenBao; its stack is never stopped by a run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import select
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

LOCK_FILE = "stack.lock"
STATE_FILE = "stack.json"
LEASE_DIR = "leases"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


@contextlib.contextmanager
def stack_lock(run_dir: Path) -> Iterator[None]:
    """Exclusive lock around starting, joining and leaving the run_dir's stack."""
    fd = os.open(_private_dir(run_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


class Lease:
    """One run's hold on the shared stack: alive while this process keeps the file locked."""

    def __init__(self, run_dir: Path) -> None:
        leases = _private_dir(run_dir / LEASE_DIR)
        self.path = leases / f"{os.getpid()}-{secrets.token_hex(4)}.lease"
        self._fh: IO[str] | None = open(self.path, "w")  # noqa: SIM115 - held for the run
        fcntl.flock(self._fh, fcntl.LOCK_EX)
        self._fh.write(f"{os.getpid()}\n")
        self._fh.flush()

    def release(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            self.path.unlink(missing_ok=True)
            fh.close()


def live_leases(run_dir: Path) -> int:
    """Leases still held; the files of crashed holders (lockable now) are removed."""
    count = 0
    for path in sorted((run_dir / LEASE_DIR).glob("*.lease")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # released meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            count += 1
            continue
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
    return count


@dataclass(frozen=True)
class StackState:
    """`<run_dir>/stack.json`: who owns the running stack and its effective config."""

    owner_pid: int
    kind: Literal["shared", "up"]
    config_file: str  # the effective config (dev Vault address filled in)
    request_file: str  # the config the owner was started with (joiners must match it)
    dev_vault: bool

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def read_state(run_dir: Path) -> StackState | None:
    try:
        raw = json.loads((run_dir / STATE_FILE).read_text())
        return StackState(**raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        raise OSError(f"{run_dir / STATE_FILE}: unreadable stack state: {e}") from None


def write_private(path: Path, text: str) -> Path:
    """Write a file only root can read (configs here may name token files)."""
    _private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def write_state(run_dir: Path, state: StackState) -> None:
    """Atomically (rename), mode 0600."""
    tmp = write_private(run_dir / f".{STATE_FILE}.{os.getpid()}", state.to_json())
    os.replace(tmp, run_dir / STATE_FILE)


def clear_state(run_dir: Path, owner_pid: int) -> None:
    """Remove the state file when it is still this owner's."""
    with contextlib.suppress(OSError):
        state = read_state(run_dir)
        if state is not None and state.owner_pid == owner_pid:
            (run_dir / STATE_FILE).unlink(missing_ok=True)


def owner_alive(pid: int) -> bool:
    """Alive and not a zombie (an exited keeper stays a zombie until its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def stop_owner(run_dir: Path, state: StackState, timeout: float) -> bool:
    """SIGTERM the keeper and wait until it has removed its state (its stack is down)."""
    try:
        # a pidfd turns readable when the keeper exits (after it removed its state): a
        # wait without polling sleeps; opened before the signal, so no pid reuse between
        pidfd = os.pidfd_open(state.owner_pid)
    except ProcessLookupError:
        return True
    try:
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.owner_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while True:
            current = _state_or_none(run_dir)
            if not owner_alive(state.owner_pid) or current is None or current != state:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # readable: the keeper exited (a zombie too), its state went before
            if select.select([pidfd], [], [], left)[0]:
                return True
    finally:
        os.close(pidfd)


def _state_or_none(run_dir: Path) -> StackState | None:
    try:
        return read_state(run_dir)
    except OSError:
        return None
