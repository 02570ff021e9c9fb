"""`stockade rules diff`: what a rule change opens and closes, per profile.

Compares effective grants (in-force allow entries a deny does not fully shadow) rather
than file text, so moving an entry into a preset or renaming an id is not reported,
while a widened wildcard, a new port, a dropped `http` block or a removed deny is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from typing import Any

from .decide import in_force, utc_today
from .lint import entry_covers, shadowing_deny
from .model import BrokerGrant, EgressEntry, Profile
from .ruleset import RuleSet


def describe(e: EgressEntry) -> str:
    dest = e.host if e.host is not None else str(e.cidr)
    ports = ",".join(str(p) for p in sorted(e.ports)) if e.ports else "any"
    text = f"{dest}:{ports}"
    if e.http is not None:
        methods = ",".join(sorted(e.http.methods)) or "any method"
        paths = " ".join(e.http.paths) or "any path"
        text += f" [{methods} {paths}]"
    elif e.host_must_match_sni:
        text += " [Host = SNI]"
    return text


def _http_covers(outer: EgressEntry, inner: EgressEntry) -> bool:
    if outer.inspected and not inner.inspected:
        return False  # inner lets a request inside TLS name any Host; outer does not
    if outer.http is None:
        return True
    if inner.http is None:
        return False
    o, i = outer.http, inner.http
    methods_ok = not o.methods or (bool(i.methods) and i.methods <= o.methods)
    paths_ok = not o.paths or (bool(i.paths) and set(i.paths) <= set(o.paths))
    return methods_ok and paths_ok


def _grants(p: Profile, today: date) -> list[EgressEntry]:
    return [e for e in p.allow if in_force(e, today) and shadowing_deny(p, e, today) is None]


def _uncovered(entries: list[EgressEntry], by: list[EgressEntry]) -> list[EgressEntry]:
    return [e for e in entries if not any(entry_covers(b, e) and _http_covers(b, e) for b in by)]


@dataclass(slots=True)
class ProfileDiff:
    name: str
    status: str  # "added" | "removed" | "changed"
    newly_allowed: list[str] = field(default_factory=list)
    no_longer_allowed: list[str] = field(default_factory=list)
    denies_added: list[str] = field(default_factory=list)
    denies_removed: list[str] = field(default_factory=list)
    settings: list[str] = field(default_factory=list)  # mode, isolation, limits, broker

    def empty(self) -> bool:
        return not (self.newly_allowed or self.no_longer_allowed or self.denies_added
                    or self.denies_removed or self.settings)  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        return {
            "profile": self.name,
            "status": self.status,
            "newly_allowed": self.newly_allowed,
            "no_longer_allowed": self.no_longer_allowed,
            "denies_added": self.denies_added,
            "denies_removed": self.denies_removed,
            "settings": self.settings,
        }


def _settings(old: Profile, new: Profile) -> list[str]:
    out = []
    if old.mode != new.mode:
        out.append(f"egress mode: {old.mode} -> {new.mode}")
    if old.proxy_env != new.proxy_env:
        out.append(f"egress proxy_env: {old.proxy_env} -> {new.proxy_env}")
    if old.isolation != new.isolation:
        out.append(f"isolation: {old.isolation} -> {new.isolation}")
    if old.limits != new.limits:
        for k in old.limits.__slots__:  # type: ignore[attr-defined]
            a, b = getattr(old.limits, k), getattr(new.limits, k)
            if a != b:
                out.append(f"limits.{k}: {a} -> {b}")
    out.extend(_broker_changes(old, new))
    if old.exports != new.exports:
        out.append("exports policy changed")
    relaxed = [", ".join(sorted(p.syscalls.allow)) if p.syscalls else "none" for p in (old, new)]
    if relaxed[0] != relaxed[1]:
        out.append(f"sandbox.syscalls allowed through the seccomp filter: {relaxed[0]} -> "
                   f"{relaxed[1]}")
    return out


def _broker_changes(old: Profile, new: Profile) -> list[str]:
    out = []
    for api in sorted(set(old.broker) | set(new.broker)):
        a, b = old.broker.get(api), new.broker.get(api)
        if a == b:
            continue
        if a is None:
            out.append(f"broker: API {api!r} granted")
        elif b is None:
            out.append(f"broker: API {api!r} no longer granted")
        else:
            out.extend(_grant_changes(api, a, b))
    return out


def _grant_changes(api: str, a: BrokerGrant, b: BrokerGrant) -> list[str]:
    out = [f"broker.{api}: operation added {op.method} {op.path}"
           for op in sorted(set(b.operations) - set(a.operations), key=str)]
    out += [f"broker.{api}: operation removed {op.method} {op.path}"
            for op in sorted(set(a.operations) - set(b.operations), key=str)]
    for k in ("rate_per_second", "burst", "budget_calls", "budget_bytes", "max_body_bytes"):
        if getattr(a, k) != getattr(b, k):
            out.append(f"broker.{api}.{k}: {getattr(a, k)} -> {getattr(b, k)}")
    return out


def diff_rulesets(old: RuleSet, new: RuleSet, today: date | None = None) -> list[ProfileDiff]:
    today = today or utc_today()
    out = []
    for name in sorted(set(old.profiles) | set(new.profiles)):
        a, b = old.profiles.get(name), new.profiles.get(name)
        if a is None:
            assert b is not None
            d = ProfileDiff(name, "added")
            d.newly_allowed = [describe(e) for e in _grants(b, today)]
        elif b is None:
            d = ProfileDiff(name, "removed")
            d.no_longer_allowed = [describe(e) for e in _grants(a, today)]
        else:
            d = ProfileDiff(name, "changed")
            ga, gb = _grants(a, today), _grants(b, today)
            d.newly_allowed = sorted({describe(e) for e in _uncovered(gb, ga)})
            d.no_longer_allowed = sorted({describe(e) for e in _uncovered(ga, gb)})
            da = {describe(e) for e in a.deny if in_force(e, today)}
            db = {describe(e) for e in b.deny if in_force(e, today)}
            d.denies_added = sorted(db - da)
            d.denies_removed = sorted(da - db)
            d.settings = _settings(a, b)
            if d.empty():
                continue
        out.append(d)
    return out
