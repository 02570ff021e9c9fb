"""An operator's kill, suspend and resume of a sandbox, by its state-file row.

`stockade sandbox kill|suspend|resume` run in a process of their own, mostly against a
sandbox that another launcher process owns: what they do is the operator's event, a
write to the sandbox's cgroups and (a kill) waiting for the owner's teardown. This module
does exactly that without a `Launcher` and without importing any backend (their modules
carry the start path: seccomp, the init, the images), so the command's wall time is the
interpreter and this, not the launcher (bench/README.md, "sandbox kill"). Only when the
owner is gone does the caller build a `Launcher` to tear the sandbox down itself.

Every tier's processes live in the sandbox's cgroups (runsc's sandbox and gofer, QEMU
too) and every backend's `kill` is `backends.CgroupControl`'s (the cgroup kill;
tests/launcher/test_operator_cli.py keeps that true), so a kill needs no backend. A
suspend or resume asks the record's backend (gVisor pauses inside its Sentry).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stockade.events import make_event
from stockade.events.taskstore import read_task_events

from .cgroups import CgroupSet
from .ending import end_due
from .state import SandboxRecord, StateFile
from .supervise import kill_marker

if TYPE_CHECKING:  # annotations only
    from .settings import LauncherSettings

Emit = Callable[[dict[str, Any]], None]
OWNER_WAIT_S = 2.0  # how long a kill waits for the owner's teardown before doing it itself
_POLL_S = 0.005  # the state file is re-read this often while the owner tears down


def operator_event(rec: SandboxRecord | None, task_id: str, what: str) -> dict[str, Any]:
    """An operator asked to kill, suspend or resume the sandbox."""
    return make_event(
        component="launcher", action="sandbox_lifecycle", task_id=task_id,
        profile=rec.profile if rec else None, source_ip=rec.guest_ip if rec else None,
        message=f"sandbox {what} requested", extra={"lifecycle": what},
    )


def cgroup_of(s: LauncherSettings, task_id: str) -> CgroupSet:
    return CgroupSet(s.cgroup_root, s.cgroup_parent, task_id)


def kill_elsewhere(rec: SandboxRecord, s: LauncherSettings, state: StateFile,
                   task_dir: Path | None = None) -> bool:
    """Kill another launcher process's sandbox (or a dead one's); True when its owner
    tore it down meanwhile (else the caller does). With `task_dir` (the per-task event
    store) a sandbox that owes an end also waits for the owner's signed task record,
    which its run writes after the end event."""
    with contextlib.suppress(OSError):
        kill_marker(rec.scratch).touch()
    cgroup_of(s, rec.task_id).kill_all()
    if not rec.owner_alive() or rec.owner_pid == os.getpid():
        return False
    # the owner notices its command died and tears down; wait for that
    deadline = time.monotonic() + OWNER_WAIT_S
    while rec.task_id in state.read():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    if task_dir is not None and end_due(rec):
        while not _recorded(task_dir, rec.task_id) and time.monotonic() < deadline:
            time.sleep(_POLL_S)  # past it: gone all the same, its end is the owner's
    return True


def _recorded(task_dir: Path, task_id: str) -> bool:
    return any(e.get("stockade", {}).get("lifecycle") == "record"
               for e in read_task_events(task_dir, task_id))


def kill(state: StateFile, s: LauncherSettings, task_id: str, emit: Emit,
         task_dir: Path | None = None) -> bool | None:
    """A kill from outside the owner: False when there is no such sandbox, True when it
    is gone (its owner tore it down; with `task_dir`, also wrote its end and record),
    None when nobody did: the caller tears it down and writes the end event
    (`Launcher.end_orphan`)."""
    rec = state.read().get(task_id)
    if rec is None:
        return False
    emit(operator_event(rec, task_id, "kill"))
    return True if kill_elsewhere(rec, s, state, task_dir) else None


def freeze(state: StateFile, s: LauncherSettings, task_id: str, frozen: bool,
           emit: Emit) -> bool:
    """Suspend (`frozen`) or resume every process of a sandbox; False when unknown."""
    rec = state.read().get(task_id)
    if rec is None:
        return False
    from .backends import backend_of  # here: only a suspend or resume needs the tier's

    emit(operator_event(rec, task_id, "suspend" if frozen else "resume"))
    backend, cg = backend_of(rec, s), cgroup_of(s, task_id)
    backend.suspend(cg) if frozen else backend.resume(cg)
    with state.locked() as records:
        if task_id in records:
            records[task_id].state = "frozen" if frozen else "running"
    return True
