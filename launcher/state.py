"""The launcher's record of live sandboxes (JSON file + flock), shared by every launcher
process on the host so `sandbox list/kill` from another process and crash recovery
(`reconcile`) see the same truth. Written by rename so a crash never tears it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stockade.procs import same_process
from stockade.tasks.registry import StateWriteError, write_atomically


@dataclass(slots=True)
class SandboxRecord:
    task_id: str
    profile: str
    slot: int
    ifname: str
    netns: str
    host_ip: str
    guest_ip: str
    guest_mac: str
    ifindex: int = 0
    owner_pid: int = 0  # the launcher process that runs it
    owner_start: int = 0  # that process's start time (procs.start_time): pid reuse safe
    pid: int = 0  # the sandbox's outermost process on the host
    scratch: str = ""
    cgroups: list[str] = field(default_factory=list)
    started_at: float = 0.0
    expires_at: float | None = None
    # pooled (a warm-pool sandbox no task has claimed) | starting | running | frozen |
    # ending | deregistering
    state: str = "starting"
    isolation: str = "container"  # the tier it runs at: container (netns) | microvm
    # the nft bypass counter, copied here by each teardown before it deletes the counter's
    # element: whichever teardown removes the record reports the count, not a zero
    bypass: int = 0
    # the control sockets a `deregistering` record's task is still registered with, and
    # how many tries failed (launcher/deregistration.py)
    deregister: list[str] = field(default_factory=list)
    deregister_failures: int = 0
    pool: str = ""  # the warm pool it was made for (poolplan.Shape.label), "" if none

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SandboxRecord:
        return SandboxRecord(**d)

    def summary(self) -> dict[str, Any]:
        """The fields `sandbox list` shows."""
        return {"task_id": self.task_id, "profile": self.profile, "address": self.guest_ip,
                "state": self.state, "isolation": self.isolation,
                "started_at": self.started_at, "expires_at": self.expires_at,
                "owner_pid": self.owner_pid, "pool": self.pool}

    def owner_alive(self) -> bool:
        """The launcher process that runs it is still there (not a later one with its pid)."""
        return same_process(self.owner_pid, self.owner_start)


def state_path(state_dir: str, nft_table: str) -> Path:
    """The state file of the launchers of one nft table."""
    return Path(state_dir) / "launcher" / f"{nft_table}.json"


class StateFile:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, SandboxRecord]]:
        """Read-modify-write under an exclusive lock; changes to the dict are saved (only
        changes: a look that changes nothing writes nothing, even on a full disk)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            records = self._read()
            before = _dump(records)
            yield records
            after = _dump(records)
            if after != before:
                self._write(after)
        finally:
            os.close(fd)  # closing drops the flock

    def read(self) -> dict[str, SandboxRecord]:
        return self._read()

    def _read(self) -> dict[str, SandboxRecord]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            # unreadable state: start empty; reconcile finds leftovers by name prefix
            return {}
        out: dict[str, SandboxRecord] = {}
        for d in data.get("sandboxes", []):
            try:
                rec = SandboxRecord.from_dict(d)
            except TypeError:
                continue
            out[rec.task_id] = rec
        return out

    def _write(self, body: str) -> None:
        """Raises StateWriteError (the old file intact) on a full or read-only disk."""
        try:
            write_atomically(self.path, body, ".launcher.")
        except OSError as e:
            raise StateWriteError(self.path, e) from None


def _dump(records: dict[str, SandboxRecord]) -> str:
    return json.dumps({"sandboxes": [asdict(r) for r in records.values()]})
