"""The decision functions: pure, called by the gateway, the DNS firewall and the broker.

Order: normalise (fail closed) -> deny entries (they override allows) -> allow entries,
most specific first -> port -> http methods/paths. Report mode turns policy denials into
allows flagged `report_only`, never a malformed request.
"""

from __future__ import annotations

import ipaddress
from datetime import UTC, date, datetime

from .globs import compile_glob, path_matches, request_path
from .hosts import HostError, is_ip_literal, normalize_host
from .index import CompiledProfile, IPAddress
from .model import BrokerGrant, EgressEntry, RequestFacts, Verdict
from .reasons import Reason
from .ruleset import RuleSet

# denials report mode may let through; malformed input stays denied in any mode
_REPORTABLE = frozenset(
    {
        Reason.NO_MATCHING_RULE,
        Reason.DENIED_BY_RULE,
        Reason.PORT_NOT_ALLOWED,
        Reason.METHOD_NOT_ALLOWED,
        Reason.PATH_NOT_ALLOWED,
        Reason.INSPECTION_UNAVAILABLE,
    }
)


def utc_today() -> date:
    return datetime.now(UTC).date()


def in_force(entry: EgressEntry, today: date | None) -> bool:
    """An entry is in force up to and including its `expires` date (UTC)."""
    if entry.expires is None:
        return True
    return (today or utc_today()) <= entry.expires


def _verdict(
    cp: CompiledProfile,
    version: str,
    allowed: bool,
    reason: Reason,
    entry: EgressEntry | None = None,
    needs_inspection: bool = False,
) -> Verdict:
    report = not allowed and cp.profile.mode == "report" and reason in _REPORTABLE
    return Verdict(
        allowed=allowed or report,
        reason=reason,
        policy_version=version,
        rule_id=entry.id if entry else None,
        entry_reason=entry.reason if entry else None,
        report_only=report,
        needs_inspection=needs_inspection,
    )


def decide(
    ruleset: RuleSet, profile_name: str, facts: RequestFacts, today: date | None = None
) -> Verdict:
    """May this request/flow go out? Name entries match `facts.host`; cidr entries match
    `facts.ip` (or an IP-literal host). Entries with an `http` block need method and path."""
    version = ruleset.version
    cp = ruleset.compiled.get(profile_name)
    if cp is None:
        return Verdict(False, Reason.UNKNOWN_PROFILE, version)
    name: str | None = None
    addr: IPAddress | None = None
    if facts.host is not None:
        try:
            host = normalize_host(facts.host)
        except HostError:
            return _verdict(cp, version, False, Reason.INVALID_HOST)
        if is_ip_literal(host):
            addr = ipaddress.ip_address(host)
        else:
            name = host
    if facts.ip is not None:
        try:
            ip = ipaddress.ip_address(facts.ip)
        except ValueError:
            return _verdict(cp, version, False, Reason.INVALID_HOST)
        if addr is not None and addr != ip:
            return _verdict(cp, version, False, Reason.DESTINATION_MISMATCH)
        addr = ip
    if name is None and addr is None:
        return _verdict(cp, version, False, Reason.INVALID_HOST)
    port = facts.port
    if not isinstance(port, int) or not 1 <= port <= 65535:
        return _verdict(cp, version, False, Reason.PORT_NOT_ALLOWED)

    for e in _matches(cp, name, addr, deny=True):
        if (not e.ports or port in e.ports) and in_force(e, today):
            return _verdict(cp, version, False, Reason.DENIED_BY_RULE, e)

    candidates = [e for e in _matches(cp, name, addr, deny=False) if in_force(e, today)]
    if not candidates:
        return _verdict(cp, version, False, Reason.NO_MATCHING_RULE)
    on_port = [e for e in candidates if port in e.ports]
    if not on_port:
        return _verdict(cp, version, False, Reason.PORT_NOT_ALLOWED, candidates[0])
    for e in on_port:
        if e.http is None:
            return _verdict(cp, version, True, Reason.ALLOWED_BY_RULE, e)

    # every entry that matched wants L7 facts
    if facts.method is None or facts.path is None:
        return _verdict(cp, version, False, Reason.INSPECTION_UNAVAILABLE, on_port[0], True)
    method = facts.method.upper()
    path_fail: EgressEntry | None = None
    for e in on_port:
        http = e.http
        assert http is not None
        method_ok = not http.methods or method in http.methods
        path_ok = not http.paths or path_matches(http.paths, facts.path)
        if method_ok and path_ok:
            return _verdict(cp, version, True, Reason.ALLOWED_BY_RULE, e, True)
        if method_ok and path_fail is None:
            path_fail = e
    if path_fail is not None:
        return _verdict(cp, version, False, Reason.PATH_NOT_ALLOWED, path_fail, True)
    return _verdict(cp, version, False, Reason.METHOD_NOT_ALLOWED, on_port[0], True)


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
    version = ruleset.version
    cp = ruleset.compiled.get(profile_name)
    if cp is None:
        return Verdict(False, Reason.UNKNOWN_PROFILE, version)
    try:
        host = normalize_host(name)
    except HostError:
        return _verdict(cp, version, False, Reason.INVALID_HOST)
    if is_ip_literal(host):
        return _verdict(cp, version, False, Reason.NO_MATCHING_RULE)
    for e in cp.deny.by_name(host):
        if not e.ports and in_force(e, today):
            return _verdict(cp, version, False, Reason.DENIED_BY_RULE, e)
    for e in cp.allow.by_name(host):
        if in_force(e, today):
            return _verdict(cp, version, True, Reason.ALLOWED_BY_RULE, e)
    return _verdict(cp, version, False, Reason.NO_MATCHING_RULE)


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
