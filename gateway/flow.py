"""The pure flow decision: sniffed facts + task profile + rule set -> one destination or a denial.

Hand-written because it is the gateway's security core: it enforces "one destination
per flow" (CONNECT authority, SNI, Host and absolute-URI authority must all name the
same host and port) before the rule engine (`stockade.policy.decide`) is asked, and it
never offers the client's original destination address as something to dial except
for raw-TCP `cidr` flows, where that address is exactly what a rule allowed.
No I/O: the asyncio shell (`tcp/pipeline.py`, `tcp/dial.py`) resolves and dials it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import date
from typing import Literal

from stockade.policy import HostError, RequestFacts, decide, normalize_host
from stockade.policy.hosts import is_ip_literal
from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from .sniff_common import SniffError
from .sniff_http import AuthorityError, RequestHead, parse_authority
from .sniff_tls import ClientHello

Listener = Literal["transparent", "proxy"]
Protocol = Literal["tls", "http", "tcp"]


@dataclass(frozen=True, slots=True)
class FlowInput:
    listener: Listener
    original_ip: str | None = None  # transparent: SO_ORIGINAL_DST (logging, port, cidr)
    original_port: int | None = None
    connect: RequestHead | None = None  # explicit proxy: the CONNECT request
    tls: ClientHello | None = None
    http: RequestHead | None = None  # the first plain-HTTP request head
    sniff_error: SniffError | None = None  # what the sniffer refused, if it did
    hint: Protocol | None = None  # which sniffer the first byte chose (for the deny reply)


@dataclass(frozen=True, slots=True)
class FlowDecision:
    allowed: bool  # effective outcome (report mode turns a policy deny into True)
    reason: Reason
    protocol: Protocol
    port: int
    host: str | None = None  # normalised name the shell resolves and dials
    ip: str | None = None  # literal address the shell dials (cidr flows only)
    rule_id: str | None = None
    report_only: bool = False
    policy_version: str = ""
    detail: str = ""


def _deny(
    reason: Reason, protocol: Protocol, port: int, version: str, detail: str, host: str | None
) -> FlowDecision:
    return FlowDecision(
        False, reason, protocol, port, host=host, policy_version=version, detail=detail
    )


def _protocol(inp: FlowInput) -> Protocol:
    if inp.tls is not None:
        return "tls"
    if inp.http is not None:
        return "http"
    return inp.hint or "tcp"


def _effective_port(inp: FlowInput) -> int | None:
    if inp.listener == "proxy":
        if inp.connect is not None:
            return inp.connect.authority.port if inp.connect.authority else None
        if inp.http is not None and inp.http.authority is not None:
            return inp.http.authority.port or 80
        return None
    return inp.original_port


def _named(inp: FlowInput) -> list[tuple[str, str, int | None]]:
    """Every (source, raw host, explicit port) the flow names."""
    out: list[tuple[str, str, int | None]] = []
    if inp.connect is not None and inp.connect.authority is not None:
        a = inp.connect.authority
        out.append(("CONNECT authority", a.host, a.port))
    if inp.tls is not None and inp.tls.sni is not None:
        out.append(("SNI", inp.tls.sni, None))
    if inp.http is not None:
        if inp.http.authority is not None:
            a = inp.http.authority
            out.append(("absolute URI", a.host, a.port))
        if inp.http.host_header is not None:
            try:
                a = parse_authority(inp.http.host_header)
            except AuthorityError:
                out.append(("Host", inp.http.host_header, None))  # fails normalisation below
            else:
                out.append(("Host", a.host, a.port))
    return out


def _cidr_fallback_ip(inp: FlowInput) -> str | None:
    """The address a raw-TCP `cidr` rule could allow: original destination or CONNECT IP."""
    if inp.listener == "transparent":
        return inp.original_ip
    if inp.connect is not None and inp.connect.authority and inp.connect.authority.is_ip:
        return inp.connect.authority.host
    return None


def _by_cidr(
    ruleset: RuleSet, profile: str, ip: str | None, port: int, today: date | None
) -> FlowDecision | None:
    """Allowed raw TCP to `ip:port` by a cidr rule (enforced, never report-only), or None."""
    if ip is None:
        return None
    try:
        canonical = normalize_host(ip)
    except HostError:
        return None
    v = decide(ruleset, profile, RequestFacts(host=None, port=port, ip=canonical), today=today)
    if v.allowed and not v.report_only:
        return FlowDecision(
            True,
            v.reason,
            "tcp",
            port,
            ip=canonical,
            rule_id=v.rule_id,
            policy_version=ruleset.version,
            detail="raw TCP by cidr rule",
        )
    return None


def decide_flow(
    inp: FlowInput,
    ruleset: RuleSet,
    profile: str,
    today: date | None = None,
    prior: FlowDecision | None = None,
) -> FlowDecision:
    """One destination for the flow, or the reason it is denied. Pure.

    `prior` is a decision already made for this flow under the same rule set (the
    CONNECT authority alone): when every structural check passes and the flow names
    exactly that host and port, its policy verdict is reused instead of asking the rule
    engine twice for the same (profile, host, port) on the connection's latency path.
    """
    version = ruleset.version
    proto = _protocol(inp)
    port = _effective_port(inp)
    if port is None:
        return _deny(Reason.INVALID_HOST, proto, 0, version, "no destination port", None)
    fallback_ip = _cidr_fallback_ip(inp)

    def refuse(reason: Reason, detail: str, host: str | None = None) -> FlowDecision:
        # anything the gateway cannot name is still fine as raw TCP where a cidr rule says so
        raw = _by_cidr(ruleset, profile, fallback_ip, port, today)
        if raw is not None and inp.hint is not None:
            raw = replace(raw, protocol=inp.hint)
        return raw if raw is not None else _deny(reason, proto, port, version, detail, host)

    if inp.sniff_error is not None:
        return refuse(inp.sniff_error.reason, inp.sniff_error.detail)
    if inp.tls is not None and inp.tls.ech:
        return refuse(Reason.ECH_PRESENT, "Encrypted ClientHello extension present")
    named = _named(inp)
    if inp.tls is not None and inp.tls.sni is None:
        return refuse(Reason.SNI_MISSING, "TLS ClientHello without server name")
    if not named:
        return refuse(Reason.SNI_MISSING, "the flow names no destination host")
    host = _one_host(named, proto, port, version)
    if isinstance(host, FlowDecision):
        return host
    if is_ip_literal(host):
        return _ip_literal_flow(ruleset, profile, host, proto, port, today)
    head = _plain_head(inp, proto)
    reused = _reuse_prior(prior, head, host, proto, port, version)
    if reused is not None:
        return reused
    return _decide_host(ruleset, profile, host, head, proto, port, today)


def _one_host(
    named: list[tuple[str, str, int | None]], proto: Protocol, port: int, version: str
) -> str | FlowDecision:
    """The one normalised host every source names, or the denial: a host that fails
    normalisation, an explicit port other than the flow's, or two different hosts."""
    hosts: set[str] = set()
    for source, raw, explicit_port in named:
        try:
            hosts.add(normalize_host(raw))
        except HostError as e:
            return _deny(Reason.INVALID_HOST, proto, port, version, f"{source}: {e}", None)
        if explicit_port is not None and explicit_port != port:
            return _deny(
                Reason.DESTINATION_MISMATCH,
                proto,
                port,
                version,
                f"{source} names port {explicit_port}, flow port is {port}",
                None,
            )
    if len(hosts) != 1:
        sources = ", ".join(s for s, _, _ in named)
        return _deny(
            Reason.DESTINATION_MISMATCH,
            proto,
            port,
            version,
            f"{sources} name different hosts",
            None,
        )
    return hosts.pop()


def _ip_literal_flow(
    ruleset: RuleSet, profile: str, host: str, proto: Protocol, port: int, today: date | None
) -> FlowDecision:
    # an address is a destination only through a cidr rule (RFC 6066 forbids IP SNI)
    raw_ok = _by_cidr(ruleset, profile, host, port, today)
    if raw_ok is not None:
        return FlowDecision(
            True,
            raw_ok.reason,
            proto,
            port,
            ip=host,
            rule_id=raw_ok.rule_id,
            policy_version=ruleset.version,
            detail="IP literal by cidr rule",
        )
    return _deny(
        Reason.NO_MATCHING_RULE,
        proto,
        port,
        ruleset.version,
        "IP literal without a cidr rule",
        host,
    )


def _plain_head(inp: FlowInput, proto: Protocol) -> RequestHead | None:
    # plain HTTP: the first (and, by force_close, only) request head gives method and
    # path, so entries with an `http:` block are decided on it, not refused for want of L7
    return inp.http if proto == "http" and inp.http is not None and inp.http.path else None


def _reuse_prior(
    prior: FlowDecision | None,
    head: RequestHead | None,
    host: str,
    proto: Protocol,
    port: int,
    version: str,
) -> FlowDecision | None:
    """`prior` (with this flow's protocol) when it answered the same question under the
    same rule set, else None."""
    if (
        prior is None
        or (head is not None and prior.reason == Reason.INSPECTION_UNAVAILABLE)
        or prior.host != host
        or prior.port != port
        or prior.ip is not None
        or prior.policy_version != version
    ):
        return None
    # same question, same rule set: the answer cannot differ (decide is pure)
    if prior.protocol == proto:
        return prior
    return FlowDecision(  # not dataclasses.replace: this is on every TLS set-up path
        prior.allowed,
        prior.reason,
        proto,
        prior.port,
        host=prior.host,
        ip=prior.ip,
        rule_id=prior.rule_id,
        report_only=prior.report_only,
        policy_version=prior.policy_version,
        detail=prior.detail,
    )


def _decide_host(
    ruleset: RuleSet,
    profile: str,
    host: str,
    head: RequestHead | None,
    proto: Protocol,
    port: int,
    today: date | None,
) -> FlowDecision:
    """Ask the rule engine about the flow's one named host (with method and path when
    plain HTTP gave them)."""
    facts = (
        RequestFacts(host=host, port=port)
        if head is None
        else RequestFacts(host=host, port=port, method=head.method, path=head.path)
    )
    v = decide(ruleset, profile, facts, today=today)
    return FlowDecision(
        allowed=v.allowed,
        reason=v.reason,
        protocol=proto,
        port=port,
        host=host,
        rule_id=v.rule_id,
        report_only=v.report_only,
        policy_version=ruleset.version,
        detail=v.entry_reason or "",
    )
