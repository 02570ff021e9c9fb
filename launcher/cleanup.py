"""Taking sandboxes apart: one sandbox's teardown (every step tolerates its piece being
gone already, so kill, crash recovery and a normal end share it) and the sweep of pieces
of this launcher's naming that no record keeps (reconcile)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from stockade.tasks import StateWriteError

from . import cgroups, netns, nft, rootfs
from .backends import NAMES, backend_for, backend_of
from .deregistration import DEREGISTERING, settle
from .ending import end_due
from .operator import cgroup_of
from .spec import TASK_ID_RE
from .state import SandboxRecord, StateFile

if TYPE_CHECKING:  # annotations only
    from .backends import Live
    from .denials import BypassCollector
    from .settings import LauncherSettings

Removed = dict[str, list[str]]  # piece kind -> names removed


def ifname_of(prefix: str, task_id: str) -> str:
    return f"{prefix}{task_id}"


def netns_of(prefix: str, task_id: str) -> str:
    return f"{prefix}-{task_id}"


def wiring(rec: SandboxRecord, proxy: bool = False) -> nft.Wiring:
    # `proxy` matters only for adding; deleting always removes the SET_PROXY element
    return nft.Wiring(rec.ifname, rec.guest_ip, rec.guest_mac, rec.host_ip, proxy=proxy)


class Cleaner:
    def __init__(self, s: LauncherSettings, state: StateFile, scratch_base: Path,
                 live: dict[str, Live], bypass: BypassCollector,
                 deregister: Callable[[str, list[str]], list[str]],
                 control_sockets: list[str]) -> None:
        self.s, self.state, self.scratch_base, self.live = s, state, scratch_base, live
        self.bypass, self.deregister, self.control_sockets = bypass, deregister, control_sockets

    def cgroup(self, task_id: str) -> cgroups.CgroupSet:
        return cgroup_of(self.s, task_id)

    def teardown(self, task_id: str) -> SandboxRecord | None:
        """Idempotent. Returns the record if this call removed it from the state file
        (then its end event is this caller's to write: launcher/ending.py), else None."""
        rec = self.state.read().get(task_id)
        live = self.live.get(task_id)
        if rec is None and live is not None:
            rec = live.record
        cg = live.cg if live else self.cgroup(task_id)
        cg.kill_all()
        if live is not None:
            live.backend.teardown(live)
        if rec is not None:  # what the tier keeps outside the cgroups (runsc's state)
            backend_of(rec, self.s).discard(task_id, self.s)
        failed: list[str] = []
        if rec is not None:
            failed = self.deregister(task_id, rec.deregister if rec.state == DEREGISTERING
                                     else live.registered if live is not None
                                     else self.control_sockets)
            rec.bypass = self._keep_bypass_count(rec)
            with contextlib.suppress(nft.NftError):
                nft.run(nft.element_commands(self.s.nft_table, "delete", [wiring(rec)]))
            netns.destroy(rec.netns, rec.ifname)
            self.bypass.ifindex.pop(rec.ifindex, None)
        else:
            p = self.s.name_prefix
            netns.destroy(netns_of(p, task_id), ifname_of(p, task_id))
        cg.remove()
        rootfs.remove_scratch(self.scratch_base / task_id)
        removed = self._settle(task_id, failed, rec.bypass if rec else 0)
        self.live.pop(task_id, None)
        return removed

    def _settle(self, task_id: str, failed: list[str], bypass: int) -> SandboxRecord | None:
        try:
            with self.state.locked() as records:
                removed = settle(records, task_id, failed, bypass)
                if end_due(removed):  # marked before the removal is written
                    self.bypass.ending.add(task_id)
                return removed
        except StateWriteError as e:
            # every piece is gone; the record (owner pid gone with this process) goes at
            # the next reconcile that can write, which then writes the end event
            logging.getLogger("stockade.launcher").error(
                "sandbox %s torn down, but its record stays: %s", task_id, e)
            return None

    def _keep_bypass_count(self, rec: SandboxRecord) -> int:
        """Copies the sandbox's nft bypass counter into its state record before the
        counter's element goes: a racing teardown that reads it after then still finds
        the count in the record it may be the one to remove."""
        count = rec.bypass
        with contextlib.suppress(OSError, ValueError):
            count = max(count, nft.bypass_count(self.s.nft_table, rec.ifname))
        with contextlib.suppress(StateWriteError), self.state.locked() as records:
            if rec.task_id in records:
                stored = records[rec.task_id]
                stored.bypass = count = max(stored.bypass, count)
        return count

    def remove_table_if_last(self) -> None:
        """The last launcher out removes the table: a one-shot `stockade run` leaves
        nothing behind; a concurrent claim re-installs it under the same lock."""
        with self.state.locked() as records:
            if not records or all(r.state == DEREGISTERING for r in records.values()):
                if nft.table_exists(self.s.nft_table):
                    nft.run(nft.delete_table_command(self.s.nft_table))
                for name in NAMES:  # the tiers' own state of this table (runsc's root)
                    backend_for(name).sweep(set(), self.s)
                cgroups.remove_parent(self.s.cgroup_root, self.s.cgroup_parent)

    # -- reconcile: sandboxes no live launcher owns, pieces no record keeps ---------------
    def reconcile(self, orphan: Callable[[str], None]) -> Removed:
        """`orphan(task_id)` removes a sandbox whose launcher is gone."""
        removed: Removed = {"sandboxes": [], "netns": [], "links": [], "elements": [],
                            "cgroups": [], "scratch": [], "containers": []}
        for tid, rec in self.state.read().items():
            try:
                if rec.state == DEREGISTERING:  # torn down; its deregistration is retried
                    continue
                if tid in self.live or (rec.owner_alive() and rec.owner_pid != os.getpid()):
                    continue
                orphan(tid)
            except Exception as e:  # one bad record must not keep every other orphan
                logging.getLogger("stockade.launcher").error(
                    "reconcile: sandbox %s: %s: %s", tid, type(e).__name__, e)
                continue
            removed["sandboxes"].append(tid)
        # under the state lock: a sandbox another launcher is creating has its record
        # written before any of its pieces exist, so nothing of a live sandbox is removed
        with self.state.locked() as records:
            self.reconcile_names(set(records), removed)
            self.bypass.end_tasks_gone_elsewhere(records)
        return removed

    def reconcile_names(self, keep: set[str], removed: Removed) -> None:
        keep_if = {ifname_of(self.s.name_prefix, t) for t in keep}
        for name in NAMES:  # a tier's own leftovers first (runsc's containers hold cgroups)
            removed.setdefault("containers", []).extend(backend_for(name).sweep(keep, self.s))
        self._netns(keep, removed)
        self._links(keep_if, removed)
        self._elements(keep_if, removed)
        self._cgroups(keep, removed)
        self._scratch(keep, removed)

    def _netns(self, keep: set[str], removed: Removed) -> None:
        p = self.s.name_prefix
        for ns in netns.list_netns(p):
            tid = ns[len(p) + 1:]
            if tid not in keep and TASK_ID_RE.match(tid):
                netns.destroy(ns, ifname_of(p, tid))
                removed["netns"].append(ns)

    def _links(self, keep_if: set[str], removed: Removed) -> None:
        p = self.s.name_prefix
        for link in netns.list_links(p):
            if link not in keep_if and TASK_ID_RE.match(link[len(p):]):
                netns.destroy(netns_of(p, link[len(p):]), link)
                removed["links"].append(link)

    def _elements(self, keep_if: set[str], removed: Removed) -> None:
        stale = []
        listed = nft.list_elements(self.s.nft_table)
        for elems in (listed.get(n, []) for n in nft.PER_SANDBOX_SETS):
            for e in elems:
                name = nft.element_ifname(e)
                if name and name not in keep_if and name.startswith(self.s.name_prefix):
                    stale.append(name)
        for name in sorted(set(stale)):
            self.delete_elements_by_name(name)
            removed["elements"].append(name)

    def _cgroups(self, keep: set[str], removed: Removed) -> None:
        for name in cgroups.leftover_names(self.s.cgroup_root, self.s.cgroup_parent):
            if name not in keep and TASK_ID_RE.match(name):
                cg = self.cgroup(name)
                cg.kill_all()
                cg.remove()
                removed["cgroups"].append(name)

    def _scratch(self, keep: set[str], removed: Removed) -> None:
        if self.scratch_base.is_dir():
            for d in self.scratch_base.iterdir():
                if d.name not in keep and TASK_ID_RE.match(d.name):
                    rootfs.remove_scratch(d)
                    removed["scratch"].append(d.name)

    def delete_elements_by_name(self, ifname: str) -> None:
        """Remove every element of an interface whose record is lost (reconcile)."""
        listed = nft.list_elements(self.s.nft_table)
        for set_name in nft.PER_SANDBOX_SETS:
            for e in listed.get(set_name, []):
                if nft.element_ifname(e) == ifname:
                    payload = {"nftables": [{"delete": {"element": {
                        "family": "inet", "table": self.s.nft_table, "name": set_name,
                        "elem": [e]}}}]}
                    with contextlib.suppress(nft.NftError):
                        nft.run(payload)
