"""A new sandbox's identity, taken under the state file's lock before any piece of it
exists: a task id, an address slot no record holds, its cgroups' names and its record."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from stockade.procs import start_time
from stockade.tasks import StateWriteError

from . import cgroups, nft
from .addresses import free_slot, slot_addresses
from .backends import Backend, Live
from .cleanup import ifname_of, netns_of
from .spec import LauncherError
from .state import SandboxRecord, StateFile

if TYPE_CHECKING:  # annotations only
    from .settings import LauncherSettings


class Claims:
    """Hands out sandboxes: `live` gets each new one before its record is visible."""

    def __init__(self, s: LauncherSettings, state: StateFile, scratch_base: Path,
                 live: dict[str, Live], params: nft.TableParams,
                 retry_deregistrations: Callable[[], None]) -> None:
        self.s, self.state, self.scratch_base, self.live = s, state, scratch_base, live
        self.params, self.retry_deregistrations = params, retry_deregistrations

    def claim(self, profile: str, ttl: float | None, isolation: str, backend: Backend,
              pool: str = "") -> Live:
        """A task id, a slot and the sandbox's record (state `starting`), written before
        any piece of it exists; on any error nothing of it is left. `pool`: a warm-pool
        sandbox of that pool (no profile, no TTL until a task claims it)."""
        # an address whose old task is still registered is never handed out (its record
        # keeps the slot); a retry that succeeds now frees it
        self.retry_deregistrations()
        rec = None
        try:
            with self.state.locked() as records:
                rec, cg = new_record(records, self.s, self.scratch_base, profile, ttl,
                                     isolation, time.time())
                rec.pool = pool
                # known as live before the record is visible: a concurrent kill() finds it
                live = self.live[rec.task_id] = Live(rec, cg, backend)
                records[rec.task_id] = rec
                # another launcher's close() may have removed the table
                if not nft.table_exists(self.s.nft_table):
                    nft.apply_table(self.params)
        except BaseException as e:  # the record was not written: nothing exists yet
            if rec is not None:
                self.live.pop(rec.task_id, None)
            if isinstance(e, StateWriteError):  # a full state disk
                raise LauncherError(f"cannot write the launcher state {e.path}: {e}") from None
            raise
        return live

    def wired(self, rec: SandboxRecord) -> None:
        """The host-side ifindex in the record before the sandbox sends anything (the fence
        self-test): the NFLOG reader of whichever launcher holds the group can then tell
        whose packets it logs."""
        with self.state.locked() as records:
            if rec.task_id in records:
                records[rec.task_id].ifindex = rec.ifindex

    def running(self, live: Live, state: str = "running") -> None:
        """The sandbox's process started: its record says so (and where it is); `pooled`:
        a warm-pool sandbox waiting for its task."""
        rec = live.record
        rec.state = state
        with self.state.locked() as records:
            if rec.task_id in records:
                records[rec.task_id].pid = live.proc.pid  # type: ignore[union-attr]
                records[rec.task_id].ifindex = rec.ifindex
                records[rec.task_id].state = state

    def bind(self, live: Live, profile: str, ttl: float) -> bool:
        """A warm-pool sandbox becomes one task's (state `starting` until its command
        runs): its profile, and its TTL counted from now. False: its record is gone or
        no longer pooled (killed while it waited), nothing changed."""
        rec = live.record
        now = time.time()
        with self.state.locked() as records:
            stored = records.get(rec.task_id)
            if stored is None or stored.state != "pooled":
                return False
            for r in (stored, rec):
                r.profile, r.started_at, r.expires_at = profile, now, now + ttl
                r.state = "starting"
        return True


def new_record(records: dict[str, SandboxRecord], s: LauncherSettings, scratch_base: Path,
               profile: str, ttl: float | None, isolation: str,
               now: float) -> tuple[SandboxRecord, cgroups.CgroupSet]:
    """The record (state `starting`) of a sandbox none of `records` collides with."""
    task_id = ""
    while not task_id or task_id in records:
        task_id = secrets.token_hex(5)
    # a record whose task is still registered keeps its slot: its address is never reused
    slot = free_slot(s.address_pool, (r.slot for r in records.values()))
    a = slot_addresses(s.address_pool, slot)
    cg = cgroups.CgroupSet(s.cgroup_root, s.cgroup_parent, task_id, s.cgroup_cpu_weight)
    rec = SandboxRecord(
        task_id=task_id, profile=profile, slot=slot,
        ifname=ifname_of(s.name_prefix, task_id), netns=netns_of(s.name_prefix, task_id),
        host_ip=a.host_ip, guest_ip=a.guest_ip,
        guest_mac=a.guest_mac, owner_pid=os.getpid(),
        owner_start=start_time(os.getpid()) or 0,
        scratch=str(scratch_base / task_id), cgroups=cg.paths,
        started_at=now, expires_at=None if ttl is None else now + ttl, isolation=isolation,
    )
    return rec, cg
