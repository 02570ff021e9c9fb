"""The decision functions: pure, called by the gateway, the DNS firewall and the broker.

Order: normalise (fail closed) -> deny entries (they override allows) -> allow entries,
most specific first -> port -> http methods/paths. Report mode turns policy denials into
allows flagged `report_only`, never a malformed request.
"""

from __future__ import annotations

import ipaddress
from datetime import UTC, date, datetime
from functools import lru_cache

from .globs import compile_glob, path_matches, request_path
from .hosts import HostError, classify_host
from .index import CompiledProfile, IPAddress
from .model import BrokerGrant, EgressEntry, RequestFacts, Verdict
from .reasons import Reason
from .ruleset import RuleSet


def utc_today() -> date:
    return datetime.now(UTC).date()


def in_force(entry: EgressEntry, today: date | None) -> bool:
    """An entry is in force up to and including its `expires` date (UTC)."""
    if entry.expires is None:
        return True
    return (today or utc_today()) <= entry.expires


def decide(
    ruleset: RuleSet, profile_name: str, facts: RequestFacts, today: date | None = None
) -> Verdict:
    """May this request/flow go out? Name entries match `facts.host`; cidr entries match
    `facts.ip` (or an IP-literal host). Inspected entries (an `http` block, or
    `host_must_match_sni`) need method and path: only the inspector knows them for TLS."""
    cp = ruleset.compiled.get(profile_name)
    if cp is None:
        return Verdict(False, Reason.UNKNOWN_PROFILE, ruleset.version)
    dest = _destination(cp, facts)
    if isinstance(dest, Verdict):
        return dest
    name, addr = dest
    port = facts.port
    if type(port) is not int or not 1 <= port <= 65535:
        # malformed, so not eligible for report mode (built directly, not via the cache)
        return Verdict(False, Reason.PORT_NOT_ALLOWED, ruleset.version)
    return _decide_entries(cp, name, addr, port, facts, today)


def _decide_entries(
    cp: CompiledProfile,
    name: str | None,
    addr: IPAddress | None,
    port: int,
    facts: RequestFacts,
    today: date | None,
) -> Verdict:
    """The rule walk for a well-formed destination: deny entries override allows, then
    the port, then (when every fitting entry is inspected) method and path."""
    for e in _matches(cp, name, addr, deny=True):
        if (not e.ports or port in e.ports) and (e.expires is None or in_force(e, today)):
            return cp.verdict(False, Reason.DENIED_BY_RULE, e)

    candidates = [
        e
        for e in _matches(cp, name, addr, deny=False)
        if e.expires is None or in_force(e, today)
    ]
    if not candidates:
        return cp.verdict(False, Reason.NO_MATCHING_RULE)
    on_port = [e for e in candidates if port in e.ports]
    if not on_port:
        return cp.verdict(False, Reason.PORT_NOT_ALLOWED, candidates[0])
    for e in on_port:
        if not e.inspected:
            return cp.verdict(True, Reason.ALLOWED_BY_RULE, e)
    return _decide_inspected(cp, on_port, facts)


def _destination(
    cp: CompiledProfile, facts: RequestFacts
) -> tuple[str | None, IPAddress | None] | Verdict:
    """(name, address) the request goes to, or the denial when the facts are malformed or
    the host (an IP literal) and the dialled IP disagree."""
    name: str | None = None
    addr: IPAddress | None = None
    if facts.host is not None:
        try:
            name, addr = classify_host(facts.host)
        except (HostError, TypeError):
            return cp.verdict(False, Reason.INVALID_HOST)
    if facts.ip is not None:
        try:
            ip = _parse_ip(facts.ip)
        except (ValueError, TypeError):
            return cp.verdict(False, Reason.INVALID_HOST)
        if addr is not None and addr != ip:
            return cp.verdict(False, Reason.DESTINATION_MISMATCH)
        addr = ip
    if name is None and addr is None:
        return cp.verdict(False, Reason.INVALID_HOST)
    return name, addr


def _decide_inspected(
    cp: CompiledProfile, on_port: list[EgressEntry], facts: RequestFacts
) -> Verdict:
    """Every entry that matched wants L7 facts (method/path, or Host == SNI per request)."""
    if facts.method is None or facts.path is None:
        return cp.verdict(False, Reason.INSPECTION_UNAVAILABLE, on_port[0], True)
    method = facts.method.upper()
    path_fail: EgressEntry | None = None
    for e in on_port:
        http = e.http
        if http is None:  # host_must_match_sni alone: any method, any path
            return cp.verdict(True, Reason.ALLOWED_BY_RULE, e, True)
        method_ok = not http.methods or method in http.methods
        path_ok = not http.paths or path_matches(http.paths, facts.path)
        if method_ok and path_ok:
            return cp.verdict(True, Reason.ALLOWED_BY_RULE, e, True)
        if method_ok and path_fail is None:
            path_fail = e
    if path_fail is not None:
        return cp.verdict(False, Reason.PATH_NOT_ALLOWED, path_fail, True)
    return cp.verdict(False, Reason.METHOD_NOT_ALLOWED, on_port[0], True)


@lru_cache(maxsize=8192)
def _parse_ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def _matches(
    cp: CompiledProfile, name: str | None, addr: IPAddress | None, *, deny: bool
) -> list[EgressEntry]:
    index = cp.deny if deny else cp.allow
    out = index.by_name(name) if name is not None else []
    if addr is not None:
        out.extend(index.by_ip(addr))
    return out


def decide_name(
    ruleset: RuleSet, profile_name: str, name: str, today: date | None = None
) -> Verdict:
    """May this name be resolved at all? For the DNS firewall.

    Allowed when some allow entry's host pattern matches (on any port) and no deny entry
    that covers every port matches. A port-limited deny does not block resolution, since
    the name stays reachable on the other ports.
    """
    cp = ruleset.compiled.get(profile_name)
    if cp is None:
        return Verdict(False, Reason.UNKNOWN_PROFILE, ruleset.version)
    try:
        host, _addr = classify_host(name)
    except (HostError, TypeError):
        return cp.verdict(False, Reason.INVALID_HOST)
    if host is None:
        return cp.verdict(False, Reason.NO_MATCHING_RULE)
    for e in cp.deny.by_name(host):
        if not e.ports and in_force(e, today):
            return cp.verdict(False, Reason.DENIED_BY_RULE, e)
    for e in cp.allow.by_name(host):
        if in_force(e, today):
            return cp.verdict(True, Reason.ALLOWED_BY_RULE, e)
    return cp.verdict(False, Reason.NO_MATCHING_RULE)


def match_operation(grant: BrokerGrant, method: str, path: str) -> bool:
    """Does the broker grant allow `method path`? Ambiguous paths never match."""
    p = request_path(path)
    if p is None:
        return False
    m = method.upper()
    return any(
        (op.method == "*" or op.method == m) and compile_glob(op.path).fullmatch(p)
        for op in grant.operations
    )
