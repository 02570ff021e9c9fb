"""The DNS firewall's decision core: parsed query + task + rules + guard state -> reply.

Sans-IO: no sockets, no clock (callers pass `now`, monotonic seconds), no resolver calls.
A query is decided in up to three pure steps so the shell can do the one I/O step
(resolution) in between:

    precheck(...)        -> Outcome (answer/deny now) | NeedResolve(name, verdict)
    before_upstream(...) -> Outcome | None   (only on a cache miss: the name budget)
    conclude(...)        -> Outcome          (CNAME chain policy, address check, TTLs)

`outcome_event` turns an Outcome into the shared event shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from functools import lru_cache
from typing import Any, Literal

from dnslib import RCODE
from stockade.policy import Reason, Verdict
from stockade.policy.decide import decide_name
from stockade.policy.hosts import HostError, normalize_host
from stockade.policy.ruleset import RuleSet

from stockade.events import make_event
from stockade.net.resolver import Resolution
from stockade.tasks.registry import Task

from .guards import GuardState, shannon_entropy
from .namebudget import DETAIL, Budget
from .packet import CLASS_IN, OPCODE_QUERY, Query, Record, Reply, rcode_name
from .settings import DnsSettings

TYPE_A = 1
TYPE_CNAME = 5
TYPE_AAAA = 28
TYPE_SVCB = 64
TYPE_HTTPS = 65
RCODE_BADVERS = 16
RESOLVED_TYPES = frozenset({TYPE_A, TYPE_AAAA, TYPE_CNAME})
EMPTY_TYPES = frozenset({TYPE_SVCB, TYPE_HTTPS})  # answered empty: no ECH config leaks

Decision = Literal["allowed", "denied"]


@dataclass(frozen=True, slots=True)
class Outcome:
    decision: Decision
    reason: Reason
    reply: Reply | None  # None: send nothing
    name: str | None = None  # the normalised question name, when it got that far
    rule_id: str | None = None
    report_only: bool = False
    policy_version: str | None = None
    message: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    log: bool = True  # False: counted in metrics, no event (see rate-event suppression)


@dataclass(frozen=True, slots=True)
class NeedResolve:
    name: str
    verdict: Verdict


def deny_rcode(settings: DnsSettings) -> int:
    return RCODE.NXDOMAIN if settings.deny_rcode == "NXDOMAIN" else RCODE.REFUSED


def _deny(settings: DnsSettings, reason: Reason, **kw: Any) -> Outcome:
    return Outcome("denied", reason, Reply(deny_rcode(settings)), **kw)


def name_from_labels(labels: tuple[bytes, ...]) -> str | None:
    """Presentation name of wire labels, or None when a label cannot be a host label
    (non-ASCII bytes, an embedded dot): such names are refused, never re-interpreted."""
    try:
        parts = [label.decode("ascii") for label in labels]
    except UnicodeDecodeError:
        return None
    if not parts or any(not p or "." in p or not p.isprintable() for p in parts):
        return None
    return ".".join(parts)


@lru_cache(maxsize=8192)
def host_of(labels: tuple[bytes, ...]) -> str | None:
    """The normalised host name of wire labels, or None when it is not one (cached: the
    same few names make up nearly every query)."""
    raw = name_from_labels(labels)
    if raw is None:
        return None
    try:
        return normalize_host(raw)
    except HostError:
        return None


def _high_entropy(labels: tuple[bytes, ...], settings: DnsSettings) -> bool:
    return any(
        len(label) >= settings.entropy_min_label_length
        and shannon_entropy(label) >= settings.entropy_threshold_bits
        for label in labels
    )


def _header_refusal(q: Query) -> Outcome | None:
    """What the header alone refuses (opcode, question count, EDNS version), or None."""
    if q.opcode != OPCODE_QUERY:
        return Outcome("denied", Reason.MALFORMED_QUERY, Reply(RCODE.NOTIMP), message="opcode")
    if q.qdcount != 1:
        return Outcome(
            "denied", Reason.MALFORMED_QUERY, Reply(RCODE.FORMERR), message="qdcount != 1"
        )
    if q.edns and q.edns_version != 0:
        # RFC 6891: an EDNS version we do not speak gets BADVERS (extended rcode 16)
        return Outcome(
            "denied", Reason.MALFORMED_QUERY, Reply(RCODE_BADVERS), message="EDNS version"
        )
    return None


def _rate_refusal(
    settings: DnsSettings, guards: GuardState, task: Task, version: str | None, now: float
) -> Outcome | None:
    """The per-task query rate: over it, refused, and only the first refusal per
    interval is logged (carrying the count of the ones suppressed before it)."""
    if guards.allow_query(task.task_id, now):
        return None
    suppressed = guards.rate_event_due(task.task_id, now)
    return _deny(
        settings,
        Reason.QUERY_RATE_EXCEEDED,
        policy_version=version,
        log=suppressed is not None,
        extra={"suppressed_events": suppressed} if suppressed else {},
    )


def _shape_refusal(q: Query, settings: DnsSettings, version: str | None) -> Outcome | None:
    """The question's class and name lengths, checked before the name is even decoded."""
    if q.qclass != CLASS_IN:
        return _deny(settings, Reason.QTYPE_REFUSED, policy_version=version, message="class")
    if any(len(label) > settings.max_label_length for label in q.labels):
        return _deny(settings, Reason.LABEL_TOO_LONG, policy_version=version)
    if sum(len(label) for label in q.labels) + len(q.labels) - 1 > settings.max_name_length:
        return _deny(settings, Reason.NAME_TOO_LONG, policy_version=version)
    return None


def _common(
    name: str, rule_id: str | None, report_only: bool, version: str | None
) -> dict[str, Any]:
    """The Outcome fields every answer about an allowed name carries."""
    return {
        "name": name,
        "rule_id": rule_id,
        "report_only": report_only,
        "policy_version": version,
    }


def _type_outcome(
    q: Query, settings: DnsSettings, verdict: Verdict, common: dict[str, Any]
) -> Outcome | None:
    """For an allowed name: refusals by query type and label entropy (never report-only:
    they guard the channel, not the policy), the empty answer for SVCB/HTTPS, or None
    when the name must be resolved."""
    if q.qtype not in RESOLVED_TYPES and q.qtype not in EMPTY_TYPES:
        return _deny(settings, Reason.QTYPE_REFUSED, **{**common, "report_only": False})
    if _high_entropy(q.labels, settings):
        return _deny(settings, Reason.HIGH_ENTROPY_LABEL, **{**common, "report_only": False})
    if q.qtype in EMPTY_TYPES:
        return Outcome("allowed", verdict.reason, Reply(RCODE.NOERROR), **common)
    return None


def precheck(
    q: Query,
    task: Task | None,
    ruleset: RuleSet | None,
    settings: DnsSettings,
    guards: GuardState,
    now: float,
    today: date | None = None,
) -> Outcome | NeedResolve:
    refused = _header_refusal(q)
    if refused is not None:
        return refused
    if task is None:
        return _deny(settings, Reason.UNKNOWN_TASK)
    if task.pooled:  # a warm-pool sandbox before its claim: nothing is resolved for it
        return _deny(settings, Reason.UNCLAIMED)
    version = ruleset.version if ruleset is not None else None
    if not guards.probe_query(task.task_id, q.labels, now):  # probes spend no rate
        refused = _rate_refusal(settings, guards, task, version, now)
        if refused is not None:
            return refused
    refused = _shape_refusal(q, settings, version)
    if refused is not None:
        return refused
    name = host_of(q.labels)
    if name is None:
        return _deny(settings, Reason.INVALID_HOST, policy_version=version)
    if ruleset is None:  # no rules loaded: fail closed
        return _deny(settings, Reason.UNKNOWN_PROFILE, name=name)
    verdict = decide_name(ruleset, task.profile, name, today)
    if not verdict.allowed:
        return _deny(
            settings, verdict.reason, name=name, rule_id=verdict.rule_id, policy_version=version
        )
    common = _common(name, verdict.rule_id, verdict.report_only, version)
    answered = _type_outcome(q, settings, verdict, common)
    if answered is not None:
        return answered
    over = guards.admit_name(task.task_id, ruleset, task.profile, name, verdict.rule_id, now)
    if over is not None:
        return budget_denial(settings, guards, task, over, common, now)
    return NeedResolve(name, verdict)


def budget_denial(
    settings: DnsSettings,
    guards: GuardState,
    task: Task,
    budget: Budget,
    common: dict[str, Any],
    now: float,
) -> Outcome:
    """A name over a name budget: refused before any upstream query (the query is the
    channel). Logged once per entry and budget, then counted (see namebudget.py)."""
    extra, log = guards.names.refusal(task.task_id, "dns", common["rule_id"] or "", budget, now)
    return _deny(
        settings,
        Reason.NAME_BUDGET_EXCEEDED,
        **{**common, "report_only": False},
        message=DETAIL[budget],
        extra=extra,
        log=log,
    )


def summary_outcomes(guards: GuardState, task: Task, settings: DnsSettings) -> list[Outcome]:
    """End-of-task summaries of the name-budget refusals this path counted but did not
    log, one per entry and budget."""
    return [
        _deny(
            settings,
            Reason.NAME_BUDGET_EXCEEDED,
            rule_id=s.rule or None,
            message=s.message,
            extra=s.extra,
        )
        for s in guards.names.take_summaries(task.task_id, "dns")
    ]


def before_upstream(
    task: Task, need: NeedResolve, settings: DnsSettings, guards: GuardState, now: float
) -> Outcome | None:
    """On a cache miss, before asking upstream: the unresolvable-name budget. Refusing
    here matters because the upstream query itself is the exfiltration channel."""
    rule = need.verdict.rule_id or ""
    if guards.unresolvable_exhausted(task.task_id, rule, need.name, now):
        return _deny(
            settings,
            Reason.UNRESOLVABLE_NAME_BUDGET,
            name=need.name,
            rule_id=need.verdict.rule_id,
            policy_version=need.verdict.policy_version,
        )
    return None


def _family(addr: str) -> int:
    # resolver addresses are canonical text: IPv6 has a colon, IPv4 never does
    return 6 if ":" in addr else 4


def _cname_policy(
    ruleset: RuleSet,
    task: Task,
    need: NeedResolve,
    cnames: tuple[str, ...],
    settings: DnsSettings,
    today: date | None,
) -> tuple[Outcome | None, bool]:
    """Every CNAME target must be allowed too: the refusal for the first that is not, or
    None and the answer's report_only (a report-only target marks the whole answer)."""
    report_only = need.verdict.report_only
    for target in cnames:
        cv = decide_name(ruleset, task.profile, target, today)
        if not cv.allowed:
            denied = _deny(
                settings,
                cv.reason,
                name=need.name,
                rule_id=cv.rule_id,
                policy_version=ruleset.version,
                message=f"CNAME target {target} is not allowed",
                extra={"cname": target},
            )
            return denied, report_only
        report_only = report_only or cv.report_only
    return None, report_only


def _error_outcome(res: Resolution, reason: Reason, common: dict[str, Any]) -> Outcome | None:
    """A resolution that failed: NXDOMAIN is passed on, any other error is SERVFAIL."""
    if res.error == "nxdomain":
        return Outcome("allowed", reason, Reply(RCODE.NXDOMAIN), **common)
    if res.error is not None:
        return Outcome(
            "denied",
            Reason.RESOLVE_FAILED,
            Reply(RCODE.SERVFAIL),
            **{**common, "report_only": False},
            extra={"resolve_error": res.error},
        )
    return None


def _cname_chain(cnames: tuple[str, ...], ttl: int) -> tuple[list[Record], str | None]:
    """The CNAME records of the chain, and the owner name of the records that follow."""
    records: list[Record] = []
    owner: str | None = None  # None: the question name as the client spelled it
    for target in cnames:
        records.append(Record(owner, "CNAME", ttl, target))
        owner = target
    return records, owner


def _address_outcome(
    q: Query,
    res: Resolution,
    reason: Reason,
    chain: tuple[list[Record], str | None],
    ttl: int,
    settings: DnsSettings,
    common: dict[str, Any],
) -> Outcome:
    """The A/AAAA answer: the allowed addresses of the asked family after the chain;
    forbidden ones are dropped and named in the event, refused when none is left."""
    records, owner = chain
    family = 4 if q.qtype == TYPE_A else 6
    rtype = "A" if family == 4 else "AAAA"
    good = [a for a in res.addresses if _family(a) == family]
    bad = [(a, c) for a, c in res.forbidden if _family(a) == family]
    extra: dict[str, Any] = {}
    if bad:
        extra["forbidden_addresses"] = [f"{a} {c}" for a, c in bad]
    if bad and not good:
        return _deny(
            settings,
            Reason.ADDRESS_FORBIDDEN,
            **{**common, "report_only": False},
            message="every address of the name is forbidden: "
            + ", ".join(sorted({c for _, c in bad})),
            extra=extra,
        )
    records.extend(Record(owner, rtype, ttl, a) for a in good)
    return Outcome("allowed", reason, Reply(RCODE.NOERROR, tuple(records)), **common, extra=extra)


def conclude(
    q: Query,
    task: Task,
    ruleset: RuleSet,
    need: NeedResolve,
    res: Resolution,
    settings: DnsSettings,
    guards: GuardState,
    now: float,
    today: date | None = None,
) -> Outcome:
    v = need.verdict
    if res.error is not None or (not res.addresses and not res.forbidden):
        guards.record_unresolvable(task.task_id, v.rule_id or "", need.name, now)
    denied, report_only = _cname_policy(ruleset, task, need, res.cnames, settings, today)
    if denied is not None:
        return denied
    common = _common(need.name, v.rule_id, report_only, ruleset.version)
    failed = _error_outcome(res, v.reason, common)
    if failed is not None:
        return failed
    ttl = max(settings.ttl_min_s, min(settings.ttl_max_s, res.remaining_ttl(now)))
    chain = _cname_chain(res.cnames, ttl)
    if q.qtype == TYPE_CNAME:
        return Outcome("allowed", v.reason, Reply(RCODE.NOERROR, tuple(chain[0][:1])), **common)
    return _address_outcome(q, res, v.reason, chain, ttl, settings, common)


def outcome_event(
    q: Query | None,
    outcome: Outcome,
    task: Task | None,
    source_ip: str | None,
    source_port: int | None,
    transport: Literal["udp", "tcp"],
) -> dict[str, Any]:
    question = None
    if q is not None:
        question = {"name": outcome.name or q.display_name, "type": q.qtype_name}
    return make_event(
        component="dns",
        action="dns_decision",
        decision=outcome.decision,
        reason=str(outcome.reason),
        task_id=task.task_id if task else None,
        profile=task.profile if task else None,
        policy_version=outcome.policy_version,
        rule_id=outcome.rule_id,
        report_only=outcome.report_only,
        source_ip=source_ip,
        source_port=source_port,
        destination_domain=outcome.name,
        transport=transport,
        protocol="dns",
        dns_question=question,
        dns_response_code=rcode_name(outcome.reply.rcode) if outcome.reply else None,
        message=outcome.message,
        extra=outcome.extra or None,
    )
