"""The per-request decision inside an inspected tunnel. Pure.

Each request (HTTP/1.1 or HTTP/2) is decided by `decide_request`: Host / :authority must
name the flow's host (a shared front-end routes by it: domain fronting), then method and
path go through `stockade.policy.decide` on the rule set version the gateway decided the
flow with. `request_syntax_error` refuses the heads that could smuggle a second request.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import date
from typing import Any

from stockade.policy import HostError, RequestFacts, decide, normalize_host
from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from ..sniff_http import AuthorityError, parse_authority
from .handoff import FlowMeta


@dataclass(frozen=True, slots=True)
class InnerRequest:
    """What the inspector saw of one request inside the tunnel."""

    method: str
    path: str  # the request target as sent (origin form: path + query)
    # every name the request gives for its destination: each Host header, the HTTP/2
    # :authority and an absolute-form authority (raw text, validated here)
    authorities: tuple[str, ...]
    upgrade: bool = False  # an Upgrade header (websocket, h2c) or extended CONNECT


@dataclass(frozen=True, slots=True)
class RequestDecision:
    allowed: bool  # effective (report mode turns a policy denial into True)
    reason: Reason
    rule_id: str | None = None
    report_only: bool = False
    policy_version: str = ""
    detail: str = ""


def _deny(reason: Reason, version: str, detail: str) -> RequestDecision:
    return RequestDecision(False, reason, policy_version=version, detail=detail)


def _authority_error(meta: FlowMeta, authorities: tuple[str, ...]) -> str | None:
    """Why the names the request gives are not the flow's host and port (None: they are)."""
    if not authorities:
        return "request names no host"
    for raw in authorities:
        try:
            a = parse_authority(raw)
            host = normalize_host(a.host)
        except (AuthorityError, HostError):
            return "malformed Host / :authority"
        if host != meta.host:
            return "Host / :authority inside TLS names another host than the SNI"
        if a.port is not None and a.port != meta.port:
            return "Host / :authority names another port"
    return None


def decide_request(
    ruleset: RuleSet, meta: FlowMeta, req: InnerRequest, today: date | None = None
) -> RequestDecision:
    """May this request inside an inspected tunnel go upstream? Pure.

    Structural refusals (another host named inside TLS, CONNECT or an upgrade inside the
    tunnel, a rule set other than the one the gateway decided with) stay denied in report
    mode, as `decide_flow`'s do; method/path refusals follow the profile's mode.
    """
    version = ruleset.version
    if version != meta.policy_version:
        return _deny(
            Reason.INSPECTION_UNAVAILABLE,
            version,
            f"inspector rules {version} differ from the gateway's {meta.policy_version}",
        )
    if req.method.upper() == "CONNECT" or req.upgrade:
        return _deny(Reason.PROTOCOL_UNRECOGNISED, version, "CONNECT or upgrade inside the tunnel")
    mismatch = _authority_error(meta, req.authorities)
    if mismatch is not None:
        return _deny(Reason.DESTINATION_MISMATCH, version, mismatch)
    v = decide(
        ruleset,
        meta.profile,
        RequestFacts(host=meta.host, port=meta.port, method=req.method, path=req.path),
        today=today,
    )
    return RequestDecision(
        allowed=v.allowed,
        reason=v.reason,
        rule_id=v.rule_id,
        report_only=v.report_only,
        policy_version=version,
        detail=v.entry_reason or "",
    )


# RFC 9110 5.6.2: token = 1*tchar
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _start_line_error(method: bytes, target: bytes) -> str | None:
    if not isinstance(method, bytes) or not _TOKEN.fullmatch(method):
        return "the method is not an RFC 9110 token"
    if not isinstance(target, bytes) or not target:
        return "empty request target"
    if any(b <= 0x20 or b >= 0x7F for b in target) or b"#" in target:
        return "the request target holds whitespace, a control, '#' or non-ASCII"
    return None


def _field_error(name: bytes, value: bytes) -> str | None:
    if not _TOKEN.fullmatch(name):
        return "a header name is not an RFC 9110 token"
    if any((b < 0x20 and b != 0x09) or b == 0x7F for b in value):
        return "a header value holds CR, LF, NUL or another control character"
    if value[:1] in (b" ", b"\t") or value[-1:] in (b" ", b"\t"):
        return "a header value starts or ends with whitespace"
    return None


def request_syntax_error(
    method: bytes, target: bytes, fields: Any, trailers: Any = None
) -> str | None:
    """Why this request head must not go upstream (None: it may be decided).

    mitmproxy (h2 4.1.0 underneath) accepts CR, LF and NUL inside HTTP/2 header values and
    inside :method / :path, and writes them verbatim when the upstream speaks HTTP/1.1: a
    second, undecided request could be smuggled behind an allowed one. So, for HTTP/1 and
    HTTP/2 alike: the method and every header name must be RFC 9110 tokens, no header
    value may hold CR, LF or NUL (or other controls but HTAB) or start/end with
    whitespace, and the request target must be printable ASCII without SP or '#'.
    Trailers are refused outright. `fields` is a sequence of (name, value) bytes pairs.
    """
    error = _start_line_error(method, target)
    if error is not None:
        return error
    for name, value in fields:
        error = _field_error(name, value)
        if error is not None:
            return error
    if trailers:
        return "trailers are not allowed"
    return None


def declares_body(fields: Any) -> bool:
    """Whether a request head announces content: a Transfer-Encoding, or a Content-Length
    other than zero. `fields`: (name, value) bytes pairs."""
    for name, value in fields:
        n = name.lower()
        if n == b"transfer-encoding" or (
            n == b"content-length" and value.strip().lstrip(b"0") != b""
        ):
            return True
    return False


def denial_body(reason: str, rule: str | None, task: str | None) -> bytes:
    """The same small JSON body the gateway sends to plain-HTTP clients (gateway/deny.py)."""
    return json.dumps(
        {"error": "denied by stockade gateway", "reason": reason, "rule": rule, "task": task},
        separators=(",", ":"),
    ).encode()
