"""L7 inspection of TLS flows: the pure pieces shared by the gateway and its inspector.

Why this shape (see ARCHITECTURE.md, "mitmproxy" pitfalls):

- The gateway keeps deciding *where* a flow goes. For a TLS flow whose matching allow
  entries are all inspected (an `http:` block, or `host_must_match_sni: true`, which
  asks only for the Host check below, on every request), it resolves the allowed name
  itself, checks the addresses against the special-purpose registry (the same
  `_checked_dial` path as every other flow, only without connecting), and hands the
  flow to the inspector with
  `CONNECT <checked-ip>:<port>`. The inspector (mitmproxy, a child process: see
  `inspector.py`) dials only that literal address, never a name and never the client's
  original destination; its `server_connect` hook refuses any other address.
- The hand-off is one HTTP CONNECT on a loopback socket the gateway opens. The flow's
  metadata (task, profile, allowed host, policy version, connection id, source) travels
  in one header, `Stockade-Flow: <base64url JSON>.<base64url HMAC-SHA256>`, signed with
  a key the gateway makes for each inspector start and hands over on the child's stdin.
  Base64url has no byte a header could be split on, so no value (a task id, a name) can
  inject a header or a line; the signature means only the gateway can name a flow's task
  and profile, even to a local process that finds the loopback port.
- After the inspector's `200`, the gateway sends the client's already-sniffed
  ClientHello and relays the rest with its ordinary Relay: the upload cap, idle timeout
  and byte counts stay on the sandbox side, exactly as for uninspected flows.
- Each request inside the tunnel (HTTP/1.1 or HTTP/2) is decided by `decide_request`
  below: Host / :authority must name the flow's host (a shared front-end routes by it:
  domain fronting), then method and path go through `stockade.policy.decide` on the
  rule set version the gateway decided the flow with.

Nothing here does I/O except the CA helpers at the bottom (files in the state dir).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import os
import re
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from stockade.policy import HostError, RequestFacts, decide, normalize_host
from stockade.policy.hosts import is_ip_literal
from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from .sniff_http import AuthorityError, parse_authority

FLOW_HEADER = "Stockade-Flow"
# the supervisor's liveness probe: `CONNECT <HEALTH_HOST>:1` without FLOW_HEADER, answered
# 403 by the inspector's event loop (never dialled: .invalid never resolves, nothing does)
HEALTH_HOST = "health.stockade.invalid"
META_VERSION = 1
_B64 = re.compile(r"^[A-Za-z0-9_-]{1,4096}$")
_PROFILE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # policy/schema.py NAME_PATTERN
_POLICY = re.compile(r"^[0-9a-f]{1,64}$")
MAX_HEADER_VALUE = 8192


class MetaError(ValueError):
    """A hand-off the inspector must refuse (never shown to the sandbox)."""


@dataclass(frozen=True, slots=True)
class FlowMeta:
    """What the gateway decided about a flow before handing it over."""

    connection_id: int
    task_id: str
    profile: str
    host: str  # the allowed name, normalised (the SNI the gateway checked)
    ip: str  # the checked address the inspector dials
    port: int
    policy_version: str
    source_ip: str = ""
    source_port: int = 0
    listener: str = "transparent"

    def validate(self) -> FlowMeta:
        """Self, or MetaError: every field has the one shape the gateway produces."""
        if type(self.connection_id) is not int or self.connection_id < 0:
            raise MetaError("connection id")
        t = self.task_id
        if not isinstance(t, str) or not t or len(t) > 128 or not t.isprintable():
            raise MetaError("task id")
        if not isinstance(self.profile, str) or not _PROFILE.fullmatch(self.profile):
            raise MetaError("profile")
        if not isinstance(self.host, str) or not self.host or len(self.host) > 253:
            raise MetaError("host")
        try:
            if normalize_host(self.host) != self.host or is_ip_literal(self.host):
                raise MetaError("host is not a normalised name")
        except HostError:
            raise MetaError("host") from None
        for ip in (self.ip, self.source_ip or "0.0.0.0"):  # noqa: S104 - a placeholder
            try:
                if not isinstance(ip, str) or str(ipaddress.ip_address(ip)) != ip:
                    raise MetaError("address is not canonical")
            except ValueError:
                raise MetaError("address") from None
        for port, low in ((self.port, 1), (self.source_port, 0)):
            if type(port) is not int or not low <= port <= 65535:
                raise MetaError("port")
        if not isinstance(self.policy_version, str) or not _POLICY.fullmatch(self.policy_version):
            raise MetaError("policy version")
        if self.listener not in ("transparent", "proxy"):
            raise MetaError("listener")
        return self

    @property
    def authority(self) -> str:
        """The CONNECT target: the checked address, bracketed when IPv6."""
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    if not _B64.fullmatch(text):
        raise MetaError("not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise MetaError("not base64url") from None


def _sign(key: bytes, payload: str) -> str:
    return _b64(hmac.new(key, payload.encode("ascii"), hashlib.sha256).digest())


def encode_meta(meta: FlowMeta, key: bytes) -> str:
    """The `Stockade-Flow` header value (validated first: MetaError if `meta` is bad)."""
    meta.validate()
    doc = {
        "v": META_VERSION,
        "conn": meta.connection_id,
        "task": meta.task_id,
        "profile": meta.profile,
        "host": meta.host,
        "ip": meta.ip,
        "port": meta.port,
        "policy": meta.policy_version,
        "src": meta.source_ip,
        "sport": meta.source_port,
        "listener": meta.listener,
    }
    payload = _b64(json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii"))
    return f"{payload}.{_sign(key, payload)}"


def decode_meta(value: str, key: bytes) -> FlowMeta:
    """Parse and verify a `Stockade-Flow` value; MetaError on anything but the exact shape."""
    if not isinstance(value, str) or len(value) > MAX_HEADER_VALUE:
        raise MetaError("header too long")
    payload, sep, sig = value.partition(".")
    if not sep:
        raise MetaError("unsigned")
    _unb64(sig)  # shape checks (base64url text only) before anything is computed
    _unb64(payload)
    if not hmac.compare_digest(_sign(key, payload), sig):
        raise MetaError("bad signature")
    try:
        doc = json.loads(_unb64(payload))
    except (ValueError, UnicodeDecodeError):
        raise MetaError("not JSON") from None
    keys = {"v", "conn", "task", "profile", "host", "ip", "port", "policy", "src", "sport"}
    if not isinstance(doc, dict) or not keys <= set(doc) or set(doc) - keys - {"listener"}:
        raise MetaError("fields")
    if doc["v"] != META_VERSION:
        raise MetaError("version")
    return FlowMeta(
        connection_id=doc["conn"],
        task_id=doc["task"],
        profile=doc["profile"],
        host=doc["host"],
        ip=doc["ip"],
        port=doc["port"],
        policy_version=doc["policy"],
        source_ip=doc["src"],
        source_port=doc["sport"],
        listener=doc.get("listener", "transparent"),
    ).validate()


def connect_request(meta: FlowMeta, key: bytes) -> bytes:
    """The hand-off request the gateway sends to the inspector."""
    target = meta.authority
    return (
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
        f"{FLOW_HEADER}: {encode_meta(meta, key)}\r\n\r\n"
    ).encode("ascii")


# -- the per-request decision ----------------------------------------------------------------


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
    if not req.authorities:
        return _deny(Reason.DESTINATION_MISMATCH, version, "request names no host")
    for raw in req.authorities:
        try:
            a = parse_authority(raw)
            host = normalize_host(a.host)
        except (AuthorityError, HostError):
            return _deny(Reason.DESTINATION_MISMATCH, version, "malformed Host / :authority")
        if host != meta.host:
            return _deny(
                Reason.DESTINATION_MISMATCH,
                version,
                "Host / :authority inside TLS names another host than the SNI",
            )
        if a.port is not None and a.port != meta.port:
            return _deny(
                Reason.DESTINATION_MISMATCH, version, "Host / :authority names another port"
            )
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
    if not isinstance(method, bytes) or not _TOKEN.fullmatch(method):
        return "the method is not an RFC 9110 token"
    if not isinstance(target, bytes) or not target:
        return "empty request target"
    if any(b <= 0x20 or b >= 0x7F for b in target) or b"#" in target:
        return "the request target holds whitespace, a control, '#' or non-ASCII"
    for name, value in fields:
        if not _TOKEN.fullmatch(name):
            return "a header name is not an RFC 9110 token"
        if any((b < 0x20 and b != 0x09) or b == 0x7F for b in value):
            return "a header value holds CR, LF, NUL or another control character"
        if value[:1] in (b" ", b"\t") or value[-1:] in (b" ", b"\t"):
            return "a header value starts or ends with whitespace"
    if trailers:
        return "trailers are not allowed"
    return None


def denial_body(reason: str, rule: str | None, task: str | None) -> bytes:
    """The same small JSON body the gateway sends to plain-HTTP clients (gateway/deny.py)."""
    return json.dumps(
        {"error": "denied by stockade gateway", "reason": reason, "rule": rule, "task": task},
        separators=(",", ":"),
    ).encode()


# -- the inspector's CA ----------------------------------------------------------------------

# mitmproxy's CertStore file names (its TlsConfig opens <confdir>/mitmproxy-ca.pem): the
# key + certificate in mitmproxy-ca.pem (0600), the certificate alone in -ca-cert.pem;
# the CA itself is named "Stockade inspection CA"
CA_BASENAME = "mitmproxy"


def ca_dir(state_dir: str | os.PathLike[str], configured: str | None = None) -> Path:
    return Path(configured) if configured else Path(state_dir) / "gateway" / "inspector-ca"


def ca_cert_file(directory: Path) -> Path:
    """The CA certificate sandboxes must trust (PEM, no key)."""
    return directory / f"{CA_BASENAME}-ca-cert.pem"


def ensure_ca(directory: Path) -> Path:
    """Create the inspector's CA once (key files 0600) and return the path of its
    certificate. A missing directory is made 0700; an existing one (an operator's
    `ca_dir`) keeps its mode and owner: it is never loosened. An existing CA is reused,
    so sandboxes keep trusting it across gateway restarts."""
    if not directory.is_dir():
        directory.mkdir(parents=True, mode=0o700, exist_ok=True)
    key_file = directory / f"{CA_BASENAME}-ca.pem"
    if not key_file.exists():
        from mitmproxy.certs import CertStore  # only where a CA is actually made

        CertStore.create_store(
            directory, CA_BASENAME, 2048, organization="Stockade", cn="Stockade inspection CA"
        )
    for secret in directory.glob(f"{CA_BASENAME}-ca.*"):  # the key and its PKCS12 copy
        os.chmod(secret, 0o600)
    return ca_cert_file(directory)


def inspection_ca_cert(config: Any) -> Path:
    """For the launcher: the PEM file sandboxes must trust for inspected flows (created
    if missing). `config` is a stockade.config.Config."""
    insp = config.gateway.inspection
    return ensure_ca(ca_dir(config.state_dir, insp.ca_dir))


# what a sandbox needs to trust the inspection CA: a bundle with the public CAs (for
# uninspected flows, which keep the upstream's own certificate) and the inspection CA. The
# launcher also puts it over the system's default bundle path (curl, git, OpenSSL, Debian's
# requests and pip read that). Only variables that never override a CA a tool was given
# explicitly: requests reads REQUESTS_CA_BUNDLE and CURL_CA_BUNDLE even when its caller
# passed verify=<file> (so `pip --cert` stops working), and GIT_SSL_CAINFO beats
# git config's http.sslCAInfo
TRUST_ENV_VARS = (
    "SSL_CERT_FILE",  # OpenSSL's default file (Python ssl's default context, Ruby, ...)
    "PIP_CERT",  # pip with its own certifi (a venv's pip); `pip --cert` still wins
    "NODE_EXTRA_CA_CERTS",  # node/npm (adds to its built-in CAs)
)
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
)


def trust_bundle(ca_cert: str | os.PathLike[str], system_bundle: str | None = None) -> bytes:
    """The PEM bundle a sandbox should trust: the system's CAs, then the inspection CA.
    `system_bundle` defaults to the first of SYSTEM_BUNDLES that exists (else certifi's)."""
    if system_bundle is None:
        system_bundle = next((p for p in SYSTEM_BUNDLES if os.path.exists(p)), None)
    if system_bundle is None:
        import certifi

        system_bundle = certifi.where()
    public = Path(system_bundle).read_bytes()
    if public and not public.endswith(b"\n"):
        public += b"\n"
    return public + Path(ca_cert).read_bytes()


def trust_env(bundle_path: str) -> dict[str, str]:
    """The environment that points every client in TRUST_ENV_VARS at `bundle_path` (a
    path as the sandbox sees it)."""
    return dict.fromkeys(TRUST_ENV_VARS, bundle_path)
