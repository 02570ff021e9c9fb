"""A torn-down sandbox's task leaves the gateway and the broker, retried until it has.

A deregistration that fails (a 507 `state_write_failed` from a full state disk, a service
that is down) leaves the task registered there: its end-of-task hooks (summaries,
`event_totals`) have not run, and a new sandbox given the same address would be
attributed to the stale task. So the sandbox's record stays in the launcher's state file
in state `deregistering`, naming the control sockets still to be told (`deregister`). Its
slot stays taken, so its address is not handed to a new sandbox (fail closed) until a
retry succeeds: before each claim of an address and in every reconcile.

The first teardown that removes a live record still claims the sandbox's end event
(launcher/ending.py): the record that stays is only a pending deregistration.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from stockade.tasks import ControlClient, ControlError, StateWriteError

from .state import SandboxRecord, StateFile

DEREGISTERING = "deregistering"

log = logging.getLogger("stockade.launcher")


def deregister(task_id: str, sockets: list[str], timeout: float = 2.0) -> list[str]:
    """Tells each control socket the task is gone; returns those that failed, each logged."""
    failed = []
    for path in sockets:
        try:
            ControlClient(path, timeout=timeout).deregister(task_id)
        except ControlError as e:  # the service's own words (507 state_write_failed: ...)
            log.error("task %s stays registered with %s: %s; retried later",
                      task_id, path, e.describe())
            failed.append(path)
        except Exception as e:  # a service that is down keeps its registry on disk
            log.error("task %s stays registered with %s: %s: %s; retried later",
                      task_id, path, type(e).__name__, e)
            failed.append(path)
    return failed


def settle(records: dict[str, SandboxRecord], task_id: str, failed: list[str],
           bypass: int = 0) -> SandboxRecord | None:
    """Under the state lock, after a teardown or a retry (pure). The record goes when every
    socket was told, else it stays `deregistering` with the sockets `failed` still owe.
    Returns the record as it was if this call ended a live sandbox (then its end event
    is the caller's), None if it was gone or already only a pending deregistration."""
    cur = records.get(task_id)
    if cur is None:
        return None
    ended = None if cur.state == DEREGISTERING else dataclasses.replace(
        cur, bypass=max(cur.bypass, bypass))
    if failed:
        cur.state, cur.deregister = DEREGISTERING, list(failed)
        cur.deregister_failures += 1
        cur.bypass = max(cur.bypass, bypass)
    else:
        del records[task_id]
    return ended


def pending(records: dict[str, SandboxRecord]) -> list[SandboxRecord]:
    return [r for r in records.values() if r.state == DEREGISTERING]


def retry_pending(state: StateFile, deregister_fn: Callable[[str, list[str]], list[str]]) -> None:
    """Tells the services again of every torn-down task they still hold (any launcher's:
    a deregistration is idempotent); each success frees its record and its address."""
    for rec in pending(state.read()):
        failed = deregister_fn(rec.task_id, rec.deregister)
        try:
            with state.locked() as records:
                settle(records, rec.task_id, failed)
        except StateWriteError as e:
            log.error("sandbox %s: its pending deregistration stays: %s", rec.task_id, e)
