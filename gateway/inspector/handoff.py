"""The hand-off of one TLS flow from the gateway to its inspector: the signed metadata.

Why this shape (see ARCHITECTURE.md, "mitmproxy" pitfalls):

- The gateway keeps deciding *where* a flow goes. For a TLS flow whose matching allow
  entries are all inspected (an `http:` block, or `host_must_match_sni: true`, which
  asks only for the Host check of `requests.decide_request`, on every request), it
  resolves the allowed name itself, checks the addresses against the special-purpose
  registry (`Dialer.checked_addresses` in `gateway/tcp/dial.py`, as for every other
  flow, only without connecting: `hand_over`), and hands the flow to the inspector with
  `CONNECT <checked-ip>:<port>`.
  The inspector (mitmproxy, a child process: see `child.py`) dials only that literal
  address, never a name and never the client's original destination; its
  `server_connect` hook refuses any other address.
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

Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any

from stockade.policy import HostError, normalize_host
from stockade.policy.hosts import is_ip_literal

FLOW_HEADER = "Stockade-Flow"
# the supervisor's liveness probe: `CONNECT <HEALTH_HOST>:1` without FLOW_HEADER, answered
# 403 by the inspector's event loop (never dialled: .invalid never resolves, nothing does)
HEALTH_HOST = "health.stockade.invalid"
META_VERSION = 1
_B64 = re.compile(r"^[A-Za-z0-9_-]{1,4096}$")
_PROFILE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # policy/schema.py NAME_PATTERN
_POLICY = re.compile(r"^[0-9a-f]{1,64}$")
MAX_HEADER_VALUE = 8192
LISTENERS = ("transparent", "proxy")


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
        """Self, or MetaError: every field has the one shape the gateway produces (the
        checks run in field order, so the first bad field names the error)."""
        _check_connection_id(self.connection_id)
        _check_task_id(self.task_id)
        _check_profile(self.profile)
        _check_host(self.host)
        _check_address(self.ip)
        _check_address(self.source_ip or "0.0.0.0")  # noqa: S104 - a placeholder
        _check_port(self.port, 1)
        _check_port(self.source_port, 0)
        _check_policy_version(self.policy_version)
        if self.listener not in LISTENERS:
            raise MetaError("listener")
        return self

    @property
    def authority(self) -> str:
        """The CONNECT target: the checked address, bracketed when IPv6."""
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


def _check_connection_id(value: Any) -> None:
    if type(value) is not int or value < 0:
        raise MetaError("connection id")


def _check_task_id(value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > 128 or not value.isprintable():
        raise MetaError("task id")


def _check_profile(value: Any) -> None:
    if not isinstance(value, str) or not _PROFILE.fullmatch(value):
        raise MetaError("profile")


def _check_host(value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > 253:
        raise MetaError("host")
    try:
        if normalize_host(value) != value or is_ip_literal(value):
            raise MetaError("host is not a normalised name")
    except HostError:
        raise MetaError("host") from None


def _check_address(value: Any) -> None:
    try:
        if not isinstance(value, str) or str(ipaddress.ip_address(value)) != value:
            raise MetaError("address is not canonical")
    except ValueError:
        raise MetaError("address") from None


def _check_port(value: Any, low: int) -> None:
    if type(value) is not int or not low <= value <= 65535:
        raise MetaError("port")


def _check_policy_version(value: Any) -> None:
    if not isinstance(value, str) or not _POLICY.fullmatch(value):
        raise MetaError("policy version")


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


def health_request() -> bytes:
    """The supervisor's liveness probe (no FLOW_HEADER: the inspector answers it 403)."""
    target = f"{HEALTH_HOST}:1"
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
