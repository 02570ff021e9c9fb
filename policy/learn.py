"""`stockade rules learn`: the smallest profile that would have allowed what tasks did.

A pure core over recorded events. Per task it collects what went through (allowed, or
let through by report mode): exact names and ports of connections, methods and path
globs of inspected requests, broker operations. Across several tasks (runs of the same
job) an item is kept only when at least `min_share` of the tasks needed it, so one odd
run does not widen the list. Every proposed entry says `reason: TODO` and carries its
evidence (events, tasks), for the team to fill in or strike.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from . import eventlog as ev

Event = dict[str, Any]
TODO = "TODO"


def path_glob(path: str) -> str:
    """The glob a request path proposes: its first segment and everything under it
    (`/simple/requests/` -> `/simple/**`), `/` for the root. Narrower than any method
    set alone, wide enough that one package more is not a new entry."""
    head = path.split("?", 1)[0].lstrip("/").split("/", 1)[0]
    return f"/{head}/**" if head else "/"


@dataclass
class Seen:
    """How often one item was used and by which tasks."""

    events: int = 0
    tasks: set[str] = field(default_factory=set)

    def add(self, task: str) -> None:
        self.events += 1
        self.tasks.add(task)


@dataclass
class Observed:
    """What the tasks did; keys are the items a profile grants."""

    tasks: set[str] = field(default_factory=set)
    hosts: dict[tuple[str, int], Seen] = field(default_factory=lambda: defaultdict(Seen))
    requests: dict[tuple[str, str, str], Seen] = field(default_factory=lambda: defaultdict(Seen))
    broker: dict[tuple[str, str, str], Seen] = field(default_factory=lambda: defaultdict(Seen))
    denied: dict[str, Seen] = field(default_factory=lambda: defaultdict(Seen))  # not proposed


def observe(events: Iterable[Event], tasks: set[str] | None, profile: str | None) -> Observed:
    """Collect the events of `tasks` (None: every task of `profile`)."""
    out = Observed()
    for e in events:
        task = ev.task_id(e)
        if not task or (tasks is not None and task not in tasks):
            continue
        if tasks is None and ev.profile(e) != profile:
            continue
        act = ev.action(e)
        if act not in ("connection_decision", "request_decision", "broker_call"):
            continue
        out.tasks.add(task)
        if not ev.allowed(e):
            out.denied[ev.destination(e) or "?"].add(task)
        elif act == "connection_decision":
            _host(out, e, task)
        elif act == "request_decision":
            _request(out, e, task)
        else:
            _broker(out, e, task)
    return out


def _host(out: Observed, e: Event, task: str) -> None:
    target, port = ev.destination(e) or ev.get(e, "destination.ip"), ev.port(e)
    if target and port:
        out.hosts[(target, port)].add(task)


def _request(out: Observed, e: Event, task: str) -> None:
    name = ev.destination(e)
    method, path = ev.get(e, "http.request.method"), ev.get(e, "url.path")
    if name and isinstance(method, str) and isinstance(path, str):
        out.requests[(name, method.upper(), path_glob(path))].add(task)


def _broker(out: Observed, e: Event, task: str) -> None:
    api, method = ev.get(e, "stockade.api"), ev.get(e, "http.request.method")
    path = ev.get(e, "url.path")
    if isinstance(api, str) and isinstance(method, str) and isinstance(path, str):
        out.broker[(api, method.upper(), path.split("?", 1)[0])].add(task)


@dataclass
class Proposal:
    tasks: list[str]
    min_share: float
    # {target: host or IP, ports, methods, paths (globs), evidence}
    allow: list[dict[str, Any]] = field(default_factory=list)
    broker: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # items too few tasks needed
    denied: dict[str, int] = field(default_factory=dict)


def _keep(seen: Seen, n: int, share: float) -> bool:
    return len(seen.tasks) >= share * n


def _evidence(seen: Seen, n: int) -> dict[str, Any]:
    return {"events": seen.events, "tasks": len(seen.tasks), "of": n,
            "task_ids": sorted(seen.tasks)}  # fmt: skip


def propose(obs: Observed, min_share: float = 1.0) -> Proposal:
    """Keep what at least `min_share` (0 < x <= 1) of the tasks needed."""
    n = len(obs.tasks)
    p = Proposal(sorted(obs.tasks), min_share, denied={k: s.events for k, s in obs.denied.items()})
    by_host: dict[str, dict[str, Any]] = {}
    for (host, port), seen in sorted(obs.hosts.items()):
        if not _keep(seen, n, min_share):
            p.dropped.append(f"{host}:{port} ({len(seen.tasks)} of {n} tasks)")
            continue
        entry = by_host.setdefault(host, {"target": host, "ports": [], "methods": set(),
                                          "paths": set(), "evidence": Seen()})  # fmt: skip
        entry["ports"].append(port)
        entry["evidence"].events += seen.events
        entry["evidence"].tasks |= seen.tasks
    for (host, method, glob), seen in sorted(obs.requests.items()):
        if host not in by_host:
            continue
        if not _keep(seen, n, min_share):
            p.dropped.append(f"{method} {host}{glob} ({len(seen.tasks)} of {n} tasks)")
            continue
        by_host[host]["methods"].add(method)
        by_host[host]["paths"].add(glob)
    inspected = {h for h, _, _ in obs.requests}
    for host, e in by_host.items():
        if host in inspected and not e["methods"]:
            # its requests were inspected but too few tasks shared any: without an http
            # block the entry would allow every method and path, wider than what ran
            p.dropped.append(f"{host}: no request shared by enough tasks")
            continue
        e["methods"], e["paths"] = sorted(e["methods"]), sorted(e["paths"])
        e["evidence"] = _evidence(e["evidence"], n)
        p.allow.append(e)
    for (api, method, path), seen in sorted(obs.broker.items()):
        if not _keep(seen, n, min_share):
            p.dropped.append(f"broker {api} {method} {path} ({len(seen.tasks)} of {n} tasks)")
            continue
        p.broker.setdefault(api, []).append({"method": method, "path": path,
                                             "evidence": _evidence(seen, n)})  # fmt: skip
    return p
