"""The loaded, validated rule model: immutable values shared by gateway, broker, launcher.

The loader (`loader.py`) turns YAML into these; everything downstream only reads them.
Host patterns here are already normalised (lower case, no trailing dot, punycode).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from datetime import date
from typing import Literal

from .reasons import Reason

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Isolation = Literal["container", "gvisor", "microvm"]
Mode = Literal["enforce", "report"]
Selftest = Literal["required", "sampled"]


@dataclass(frozen=True, slots=True)
class SourceLocation:
    file: str
    line: int  # 1-based
    column: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True, slots=True)
class HttpRule:
    """L7 constraints of an egress entry; present only where method/path matter."""

    methods: frozenset[str]  # upper case; empty = any method
    paths: tuple[str, ...]  # globs on the URL path; empty = any path


@dataclass(frozen=True, slots=True)
class EgressEntry:
    id: str
    reason: str
    host: str | None = None  # "example.com" or "*.example.com" (subdomains only)
    cidr: IPNetwork | None = None
    # empty = every port; only deny entries without `ports:` have that (a deny that covered
    # just 443 would leave the same host open on other ports)
    ports: frozenset[int] = frozenset({443})
    expires: date | None = None
    review_by: date | None = None  # next periodic review due (lint warns once past)
    owner: str | None = None  # who answers for the entry at review
    http: HttpRule | None = None
    # inspected only to hold every request's Host / :authority to the SNI (no http rule)
    host_must_match_sni: bool = False
    accept_fronting: str | None = None  # why an uninspected shared front-end is accepted
    origin: str = ""  # "profile:NAME" or "preset:NAME"
    location: SourceLocation | None = None

    @property
    def inspected(self) -> bool:
        """Do this entry's TLS flows go through the L7 inspector (which holds every
        request's Host / :authority to the SNI)?"""
        return self.http is not None or self.host_must_match_sni


@dataclass(frozen=True, slots=True)
class Limits:
    cpus: float = 1.0
    memory: int = 512 * 2**20  # bytes
    disk: int = 1 * 2**30  # bytes of scratch
    pids: int = 256
    ttl: int = 300  # seconds of wall clock
    egress_bytes: int = 1 * 2**30  # bytes uploaded through the gateway per task


@dataclass(frozen=True, slots=True)
class BrokerOperation:
    method: str  # upper case, or "*"
    path: str  # glob on the API path, e.g. "/repos/*/issues"


@dataclass(frozen=True, slots=True)
class BrokerGrant:
    """What one profile may do with one API through the broker."""

    api: str
    operations: tuple[BrokerOperation, ...]
    rate_per_second: float = 10.0
    burst: int = 20
    budget_calls: int | None = None
    budget_bytes: int | None = None
    max_body_bytes: int = 1 * 2**20


@dataclass(frozen=True, slots=True)
class ExportPolicy:
    max_file_bytes: int = 10 * 2**20
    max_total_bytes: int = 50 * 2**20
    types: tuple[str, ...] = ("text", "json")  # content kinds checked by content sniffing


# system calls a profile may take out of the container tier's seccomp filter
# (`sandbox.syscalls.allow`); the launcher's filter (launcher/seccomp_rules.py) denies each
# of them by default. Namespaces, mounts, bpf, keyrings, io_uring and modules never are.
RELAXABLE_SYSCALLS = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
                      "pidfd_getfd", "personality", "perf_event_open")


@dataclass(frozen=True, slots=True)
class SyscallRelaxation:
    """`sandbox.syscalls`: calls the sandbox's seccomp filter lets through, and why."""

    allow: frozenset[str]
    reason: str
    location: SourceLocation | None = None


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    isolation: Isolation = "container"
    limits: Limits = field(default_factory=Limits)
    mode: Mode = "enforce"
    # own entries first, then those of `presets` (expanded at load time; see entry.origin)
    allow: tuple[EgressEntry, ...] = ()
    deny: tuple[EgressEntry, ...] = ()
    presets: tuple[str, ...] = ()
    broker: dict[str, BrokerGrant] = field(default_factory=dict)
    exports: ExportPolicy = field(default_factory=ExportPolicy)
    location: SourceLocation | None = None
    # egress.proxy_env: the launcher points HTTP(S)_PROXY at the gateway's explicit proxy
    proxy_env: bool = False
    # sandbox.syscalls: relaxations of the seccomp filter; None = the full default filter
    syscalls: SyscallRelaxation | None = None
    # the launcher's fence self-test: on every start (required), or on the share of starts
    # launcher.selftest.sample_rate gives (sampled)
    selftest: Selftest = "required"


@dataclass(frozen=True, slots=True)
class CredentialSource:
    """A Vault KV v2 secret: mount, path, field."""

    mount: str
    path: str
    field: str


@dataclass(frozen=True, slots=True)
class Injection:
    style: Literal["bearer", "header", "basic", "query"]
    header: str | None = None  # for style=header, e.g. "X-Api-Key"
    template: str | None = None  # for style=header, e.g. "Token {secret}"
    query_param: str | None = None  # for style=query
    username: str | None = None  # for style=basic (secret is the password)


@dataclass(frozen=True, slots=True)
class ApiDefinition:
    name: str
    base_url: str  # https://host[:port][/prefix]; http only with allow_plain_http
    credential: CredentialSource
    injection: Injection
    allow_plain_http: bool = False
    description: str = ""
    location: SourceLocation | None = None


@dataclass(frozen=True, slots=True)
class PolicyTestCase:
    profile: str
    target: str  # URL or host:port
    method: str | None
    expect: Literal["allow", "deny"]
    rule: str | None = None  # expected rule id
    reason: str | None = None  # expected reason code
    location: SourceLocation | None = None


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the enforcement point knows about one request or flow."""

    host: str | None = None  # SNI / Host / CONNECT authority; raw, normalised by decide()
    port: int = 443
    ip: str | None = None  # destination IP literal, for cidr rules
    method: str | None = None  # known only for plain HTTP or inspected flows
    path: str | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool  # the effective outcome (report mode turns a deny into True)
    reason: Reason
    policy_version: str
    rule_id: str | None = None
    entry_reason: str | None = None  # the matching entry's human `reason`
    report_only: bool = False  # True when the rules denied but report mode let it through
    needs_inspection: bool = False  # the matching entry is inspected (EgressEntry.inspected)


@dataclass(frozen=True, slots=True)
class Preset:
    """A reusable set of egress entries (`rules/presets/*.yaml`), expanded into profiles."""

    name: str
    description: str
    allow: tuple[EgressEntry, ...] = ()
    deny: tuple[EgressEntry, ...] = ()
    location: SourceLocation | None = None


@dataclass(frozen=True, slots=True)
class SharedFrontend:
    """One name pattern or address range of a shared front-end (a CDN edge that routes
    by Host), from `rules/catalogues/*.yaml`; only `stockade rules lint` reads these."""

    provider: str
    source: str  # URL of the provider's published list or documentation
    checked: date
    host: str | None = None  # normalised pattern, e.g. "*.fastly.net"
    cidr: IPNetwork | None = None
    location: SourceLocation | None = None

    def __str__(self) -> str:
        return self.host if self.host is not None else str(self.cidr)
