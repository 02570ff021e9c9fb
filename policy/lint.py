"""Warnings about rule sets that load fine but are probably not what the author meant.

Warnings never refuse a rule set: expired entries, allow entries a deny fully shadows,
allow entries that can write to a service of the upload catalogue (upload_services.yaml:
a wildcard over one unless inspected read-only, an exact name with every method), unused presets,
uninspected entries on a shared front-end of the catalogue (`rules/catalogues/`; an
error with `strict`), system calls a profile takes out of the sandbox's seccomp filter
(with its reason). Notes only inform: an entry's explicit `accept_fronting`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import date
from itertools import chain

from .decide import in_force, utc_today
from .model import EgressEntry, Profile, SharedFrontend
from .problems import Problem
from .ruleset import RuleSet
from .uploads import upload_services

# read-only methods: an entry inspected with only these cannot write to an upload service
READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def pattern_covers(outer: str, inner: str) -> bool:
    """Does host pattern `outer` match every name `inner` matches?"""
    if outer == inner:
        return True
    if outer.startswith("*."):
        suffix = outer[1:]  # ".example.com"
        base = inner[2:] if inner.startswith("*.") else inner
        return base.endswith(suffix)
    return False


def entry_covers(outer: EgressEntry, inner: EgressEntry) -> bool:
    """Does `outer` match every destination and port `inner` matches?"""
    ports_ok = not outer.ports or (bool(inner.ports) and inner.ports <= outer.ports)
    if not ports_ok:
        return False
    if outer.host is not None and inner.host is not None:
        return pattern_covers(outer.host, inner.host)
    if outer.cidr is not None and inner.cidr is not None:
        return outer.cidr.version == inner.cidr.version and inner.cidr.subnet_of(outer.cidr)  # type: ignore[arg-type]
    return False


def _where(e: EgressEntry) -> tuple[str, int, int]:
    loc = e.location
    return (loc.file, loc.line, loc.column) if loc else ("?", 1, 1)


def _warn(e: EgressEntry, message: str) -> Problem:
    f, line, col = _where(e)
    return Problem(f, line, col, message, "warning")


def shared_frontend(e: EgressEntry, catalogue: Iterable[SharedFrontend]) -> SharedFrontend | None:
    """The catalogue item `e` reaches: a name pattern either covers the other (an entry
    `*.net` reaches `*.fastly.net`), or the entry's range overlaps a front-end range."""
    for f in catalogue:
        if e.host is not None and f.host is not None:
            hit = pattern_covers(f.host, e.host) or pattern_covers(e.host, f.host)
        elif e.cidr is not None and f.cidr is not None:
            hit = e.cidr.version == f.cidr.version and e.cidr.overlaps(f.cidr)  # type: ignore[arg-type]
        else:
            hit = False
        if hit:
            return f
    return None


def missing_catalogue(rs: RuleSet, root: str) -> Problem | None:
    """Under `--strict`, a rules directory without any shared front-end: the fronting
    check would pass by checking nothing (a rules copy without `catalogues/`)."""
    if rs.frontends:
        return None
    return Problem(f"{root.rstrip('/')}/catalogues", 1, 1,
                   "catalogues: no shared front-end catalogue, so --strict cannot check "
                   "entries for domain fronting; copy rules/catalogues/shared-frontends.yaml "
                   "into this rules directory", "error")  # fmt: skip


def _frontend_problem(e: EgressEntry, f: SharedFrontend, strict: bool) -> Problem | None:
    """An uninspected entry on a shared front-end: a warning (strict: an error), or a
    note when the entry says why it accepts fronting. Inspected entries are fine."""
    if e.inspected:
        return None
    file, line, col = _where(e)
    where = f"{f} ({f.provider}, {f.source})"
    if e.accept_fronting is not None:
        msg = (f"entry {e.id!r} reaches the shared front-end {where} uninspected by choice "
               f"(accept_fronting: {e.accept_fronting})")  # fmt: skip
        return Problem(file, line, col, msg, "note")
    if e.host is not None:
        fix = "set 'host_must_match_sni: true' (or an 'http' block) or declare"
    else:
        fix = "allow its names with 'host_must_match_sni: true' instead, or declare"
    msg = (f"entry {e.id!r} reaches the shared front-end {where} without inspection: a "
           "request inside TLS can name any other site behind it in its Host (domain "
           f"fronting); {fix} 'accept_fronting: <why>'")  # fmt: skip
    return Problem(file, line, col, msg, "error" if strict else "warning")


def _defined_entries(rs: RuleSet, deny: bool = True) -> Iterable[EgressEntry]:
    """Each entry once, where it is written (a preset's entries are not repeated for
    every profile that uses it); deny entries too unless `deny` is False."""
    for preset in rs.presets.values():
        yield from preset.allow
        if deny:
            yield from preset.deny
    for p in rs.profiles.values():
        origin = f"profile:{p.name}"
        yield from (e for e in p.allow + (p.deny if deny else ()) if e.origin == origin)


def shadowing_deny(profile: Profile, entry: EgressEntry, today: date) -> EgressEntry | None:
    for d in profile.deny:
        if in_force(d, today) and entry_covers(d, entry):
            return d
    return None


def _frontend_problems(rs: RuleSet, today: date, strict: bool) -> Iterable[Problem]:
    """The fronting problem of every in-force allow entry on a shared front-end."""
    for e in _defined_entries(rs, deny=False):
        front = shared_frontend(e, rs.frontends) if in_force(e, today) else None
        fp = _frontend_problem(e, front, strict) if front is not None else None
        if fp is not None:
            yield fp


def _profile_problems(p: Profile) -> Iterable[Problem]:
    """Profile-wide warnings: seccomp relaxations (with their reason), report mode."""
    relax = p.syscalls
    if relax is not None and relax.location is not None:
        loc = relax.location
        yield Problem(loc.file, loc.line, loc.column,
                      f"sandbox.syscalls: profile {p.name!r} lets "
                      f"{', '.join(sorted(relax.allow))} through the seccomp filter "
                      f"(reason: {relax.reason})", "warning")  # fmt: skip
    if p.mode == "report" and p.location is not None:
        loc = p.location
        msg = (f"egress.mode: profile {p.name!r} is in report mode: denials are logged "
               "but not enforced")  # fmt: skip
        yield Problem(loc.file, loc.line, loc.column, msg, "warning")


def lint_ruleset(
    rs: RuleSet, today: date | None = None, expiring_within: int = 14, strict: bool = False
) -> list[Problem]:
    """Warnings for a loaded rule set; `expiring_within` days ahead flags entries about to
    lapse (0 turns that off). `strict` makes an uninspected entry on a shared front-end
    without `accept_fronting` an error."""
    today = today or utc_today()
    out: dict[tuple[str, int, int, str], Problem] = {}
    for p in chain(
        _frontend_problems(rs, today, strict),
        _expiry_problems(rs, today, expiring_within),
        _profiles_problems(rs, today),
        _unused_presets(rs),
    ):
        out.setdefault((p.file, p.line, p.column, p.message), p)
    return sorted(out.values(), key=lambda p: (p.file, p.line, p.column, p.message))


def _expiry_problems(rs: RuleSet, today: date, expiring_within: int) -> Iterable[Problem]:
    """Entries expired (not in force), expiring within `expiring_within` days, or past
    their `review_by`."""
    for e in _defined_entries(rs):
        if not in_force(e, today):
            yield _warn(e, f"entry {e.id!r} expired on {e.expires}; it is not in force "
                           "(remove it or extend 'expires')")  # fmt: skip
        elif e.expires is not None and (e.expires - today).days < expiring_within:
            days = (e.expires - today).days
            yield _warn(e, f"entry {e.id!r} expires on {e.expires} (in {days} day(s)); "
                           "review whether it is still needed")  # fmt: skip
        if e.review_by is not None and e.review_by < today:
            who = f" (owner: {e.owner})" if e.owner else ""
            yield _warn(e, f"entry {e.id!r} was due for review on {e.review_by}{who}; "
                           "review it and move 'review_by' on")  # fmt: skip


def _profiles_problems(rs: RuleSet, today: date) -> Iterable[Problem]:
    """Each profile's own warnings, then those of its in-force allow entries."""
    for p in rs.profiles.values():
        yield from _profile_problems(p)
        for e in p.allow:
            if in_force(e, today):
                yield from _allow_problems(p, e, today)


def _allow_problems(p: Profile, e: EgressEntry, today: date) -> Iterable[Problem]:
    """An allow entry's inspection that has no effect, a deny that shadows it, or an upload
    host it reaches with every method."""
    if e.inspected:
        wider = _uninspected_cover(p, e, today)
        if wider is not None:
            what = "http block" if e.http is not None else "host_must_match_sni"
            yield _warn(e, f"the {what} of {e.id!r} has no effect in profile "
                           f"{p.name!r}: {wider.id!r} allows the same hosts and ports "
                           "without inspection")  # fmt: skip
    d = shadowing_deny(p, e, today)
    if d is not None:
        yield _warn(e, f"entry {e.id!r} is shadowed by deny {d.id!r} in profile "
                       f"{p.name!r}; it never allows anything there")  # fmt: skip
        return
    yield from _upload_problems(p, e, today)


def _upload_problems(p: Profile, e: EgressEntry, today: date) -> Iterable[Problem]:
    """An entry that can write to a service of the upload catalogue (upload_services.yaml):
    a wildcard over one, unless inspected with read-only methods; an exact name of one
    with every method. One warning per entry."""
    if e.host is None:
        return
    services = [u for u in upload_services() if not _denied(p, u.host, today)]
    if e.host.startswith("*.") and not _read_only(e):
        for u in services:
            if pattern_covers(e.host, u.host) or pattern_covers(u.host, e.host):
                yield _warn(e, f"entry {e.id!r} is a wildcard over {u}, which accepts "
                               "uploads from anyone: every name under it is a place to "
                               "write data to; allow the exact names needed, or inspect "
                               "it read-only (http: {methods: [GET, HEAD]})")  # fmt: skip
                return
    if _any_method(e):
        for u in services:
            if not u.host.startswith("*.") and pattern_covers(e.host, u.host):
                yield _warn(e, f"entry {e.id!r} reaches {u.host}, which accepts uploads, "
                               "without an 'http' block (limit methods/paths, e.g. "
                               "GET/HEAD)")  # fmt: skip
                return


def _unused_presets(rs: RuleSet) -> Iterable[Problem]:
    used = {name for p in rs.profiles.values() for name in p.presets}
    for name, preset in rs.presets.items():
        if name not in used and preset.location is not None:
            loc = preset.location
            yield Problem(loc.file, loc.line, loc.column,
                          f"preset: {name!r} is not used by any profile", "warning")  # fmt: skip


def _read_only(e: EgressEntry) -> bool:
    """Is the entry inspected with read-only methods only?"""
    return e.http is not None and bool(e.http.methods) and e.http.methods <= READ_ONLY_METHODS


def _any_method(e: EgressEntry) -> bool:
    """Does the entry let every method and path through (no http rule that limits them)?"""
    return e.http is None or (not e.http.methods and not e.http.paths)


def _uninspected_cover(profile: Profile, entry: EgressEntry, today: date) -> EgressEntry | None:
    for other in profile.allow:
        if not other.inspected and in_force(other, today) and entry_covers(other, entry):
            return other
    return None


def _denied(profile: Profile, host: str, today: date) -> bool:
    return any(
        d.host is not None and not d.ports and in_force(d, today) and pattern_covers(d.host, host)
        for d in profile.deny
    )
