"""What a run may leave on the host, listed so a test can compare before and after."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from e2e_instance import forked_stack_procs


def _out(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def snapshot(
    prefixes: tuple[str, ...], cgroup_parent: str, proc_marker: str
) -> dict[str, set[str]]:
    """Namespaces, links, nft tables and processes whose names carry a prefix, and the
    cgroups below `cgroup_parent` (v1 controllers or the v2 tree)."""
    netns = {line.split()[0] for line in _out(["ip", "netns", "list"]).splitlines() if line}
    links = {d["ifname"] for d in json.loads(_out(["ip", "-j", "link", "show"]) or "[]")}
    tables = {
        t["table"]["name"]
        for t in json.loads(_out(["nft", "-j", "list", "tables"]) or "{}").get("nftables", [])
        if "table" in t
    }
    # the sandboxes' cgroups and their parent (removed by the last launcher out)
    cgroups = {
        str(p)
        for root in [Path("/sys/fs/cgroup"), *Path("/sys/fs/cgroup").glob("*")]
        for p in root.glob(cgroup_parent)
        if p.is_dir()
    }
    # services whose config path carries the run's marker, and orphaned dev OpenBao servers
    # (a leaked one is re-parented to init; other tests' servers still have their parent)
    procs = set()
    for line in _out(["ps", "-ww", "-eo", "ppid=,args="]).splitlines():  # -ww: no COLUMNS cut
        ppid, _, args = line.strip().partition(" ")
        if ("serve --config" in args and proc_marker in args) or (
            "bao server -dev" in args and ppid == "1"
        ):
            procs.add(args)
    # the stack's processes forked from its keeper carry the starting run's command line
    procs |= {f"{comm} {pid}" for pid, comm in forked_stack_procs(proc_marker).items()}

    def keep(names: set[str]) -> set[str]:
        return {n for n in names if any(n.startswith(p) for p in prefixes)}

    return {
        "netns": keep(netns),
        "links": keep(links),
        "tables": keep(tables),
        "cgroups": cgroups,
        "procs": procs,
    }


def new_since(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, set[str]]:
    return {k: after[k] - before[k] for k in after if after[k] - before[k]}
