"""Incremental, pure parser of an HTTP/1.x request head: method, target, Host.

Hand-written on purpose: the gateway must decide on the head before any byte goes
upstream, keep the bytes for replay, and be stricter than a server library (CRLF only,
no obs-fold, exactly one Host, no userinfo, a hard size cap) so that the gateway and the
upstream cannot disagree about which host a request names. h11 would parse the head,
but it consumes the stream and tolerates what we must refuse.

Usage: `s = HttpSniffer(max_bytes); r = s.feed(chunk)` until `r` is not `NEED_MORE`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from stockade.policy.reasons import Reason

from .sniff_common import NEED_MORE, NeedMore, SniffError

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_METHOD = re.compile(rb"[A-Z][A-Z0-9\-_]{0,23}")
_VERSION = re.compile(rb"HTTP/1\.[01]")
_TARGET_BYTES = re.compile(rb"[\x21-\x7e]+")
_VALUE_BYTES = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_PORT = re.compile(r"[0-9]{1,5}")
_HOST_CHARS = re.compile(r"[A-Za-z0-9\-._~%!$&'()*+,;=:]+")

TargetForm = Literal["origin", "absolute", "authority", "asterisk"]


class AuthorityError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Authority:
    host: str  # raw host (brackets removed from IPv6 literals), not yet normalised
    port: int | None  # None when absent
    is_ip: bool


@lru_cache(maxsize=4096)
def parse_authority(raw: str) -> Authority:
    """`host`, `host:port`, `[v6]` or `[v6]:port`; userinfo and anything odd are refused.

    Cached (pure, immutable result; a refusal raises and is not cached): a task names
    the same few authorities on every connection, and the IP-literal probe costs an
    exception per name."""
    if not raw or "@" in raw or any(c in raw for c in "/?#\\ \t"):
        raise AuthorityError("malformed authority")
    if raw.startswith("["):
        host, port_text = _bracketed(raw)
        is_ip = True
    else:
        host, port_text, is_ip = _bare(raw)
    return Authority(host, None if port_text is None else _port(port_text), is_ip)


def _bracketed(raw: str) -> tuple[str, str | None]:
    """(IPv6 literal, port text or None) of `[v6]` or `[v6]:port`."""
    end = raw.find("]")
    if end < 0:
        raise AuthorityError("unclosed [")
    host = raw[1:end]
    rest = raw[end + 1 :]
    port_text: str | None = None
    if rest:
        if not rest.startswith(":"):
            raise AuthorityError("junk after ]")
        port_text = rest[1:]
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise AuthorityError("[...] is not an IPv6 literal") from None
    return host, port_text


def _bare(raw: str) -> tuple[str, str | None, bool]:
    """(host, port text or None, host is an IPv4 literal) of `host` or `host:port`."""
    host, sep, port_part = raw.partition(":")
    if ":" in port_part or "[" in host or "]" in host:
        raise AuthorityError("bare IPv6 or extra colon")
    if not host or not _HOST_CHARS.fullmatch(host):
        raise AuthorityError("bad host characters")
    port_text = port_part if sep else None
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return host, port_text, False
    return host, port_text, True


def _port(text: str) -> int:
    if not _PORT.fullmatch(text) or not 0 < int(text) < 65536:
        raise AuthorityError("bad port")
    return int(text)


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    target: str
    version: str
    form: TargetForm
    host_header: str | None  # raw value of the single Host header
    authority: Authority | None  # from an absolute-form or authority-form target
    path: str | None  # origin/absolute form: path + query
    head_len: int  # bytes up to and including the blank line
    headers: tuple[tuple[str, str], ...]


def _split_target(method: str, target: str) -> tuple[TargetForm, Authority | None, str | None]:
    if method == "CONNECT":
        return "authority", parse_authority(target), None
    if target == "*":
        return "asterisk", None, None
    if target.startswith("/"):
        return "origin", None, target
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() != "http":
        raise AuthorityError("absolute-form target must be http://")
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    auth = parse_authority(rest[:cut])
    path = rest[cut:] or "/"
    if path.startswith("#") or path.startswith("?"):
        path = "/" + path
    return "absolute", auth, path


def parse_head(head: bytes) -> RequestHead | SniffError:
    """Parse a complete head (ending in CRLF CRLF).

    Heads up to CACHED_HEAD_BYTES are memoised (pure function, immutable results): a
    client repeats the same CONNECT head, byte for byte, on every connection. The cache
    is bounded, so a hostile client can only churn it, not grow it."""
    if len(head) <= CACHED_HEAD_BYTES:
        return _parse_head_cached(head)
    return _parse_head(head)


CACHED_HEAD_BYTES = 512


@lru_cache(maxsize=1024)
def _parse_head_cached(head: bytes) -> RequestHead | SniffError:
    return _parse_head(head)


def _parse_head(head: bytes) -> RequestHead | SniffError:
    lines = head[:-4].split(b"\r\n")
    if any(b"\n" in line or b"\r" in line for line in lines):
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "bare CR or LF in request head")
    request_line = _request_line(lines[0])
    if isinstance(request_line, SniffError):
        return request_line
    method, target, version = request_line
    headers = _header_fields(lines[1:])
    if isinstance(headers, SniffError):
        return headers
    hosts = [value for name, value in headers if name.lower() == "host"]
    if len(hosts) > 1:
        return SniffError(Reason.DESTINATION_MISMATCH, "more than one Host header")
    try:
        form, authority, path = _split_target(method, target)
        if hosts:
            parse_authority(hosts[0])  # validated here, compared in flow.py
    except AuthorityError as e:
        return SniffError(Reason.INVALID_HOST, str(e))
    if form == "authority" and method != "CONNECT":
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "authority-form without CONNECT")
    return RequestHead(
        method=method,
        target=target,
        version=version,
        form=form,
        host_header=hosts[0] if hosts else None,
        authority=authority,
        path=path,
        head_len=len(head),
        headers=headers,
    )


def _request_line(line: bytes) -> tuple[str, str, str] | SniffError:
    """(method, target, version) of a request line, or the refusal."""
    parts = line.split(b" ")
    if len(parts) != 3:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "malformed request line")
    m, t, v = parts
    if not _METHOD.fullmatch(m) or not _TARGET_BYTES.fullmatch(t) or not _VERSION.fullmatch(v):
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "malformed request line")
    return m.decode(), t.decode(), v.decode()


def _header_fields(lines: list[bytes]) -> tuple[tuple[str, str], ...] | SniffError:
    """(name, value) of each header line in order (value stripped, latin-1), or the
    refusal of the first malformed one."""
    headers: list[tuple[str, str]] = []
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            # includes obs-fold (leading whitespace) and empty names
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "malformed header line")
        value = value.strip(b" \t")
        if not _VALUE_BYTES.fullmatch(value):
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "control character in header")
        headers.append((name.decode("ascii"), value.decode("latin-1")))
    return tuple(headers)


class HttpSniffer:
    """Buffers bytes until the blank line that ends the head (or the cap is hit)."""

    def __init__(self, max_bytes: int = 16384) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._result: RequestHead | SniffError | None = None

    def feed(self, data: bytes) -> NeedMore | RequestHead | SniffError:
        if self._result is not None:
            return self._result
        start = max(0, len(self._buf) - 3)
        self._buf += data
        end = self._buf.find(b"\r\n\r\n", start)
        if end < 0:
            if len(self._buf) > self.max_bytes:
                self._result = SniffError(Reason.HEAD_TOO_LARGE, "request head exceeds the cap")
                return self._result
            if not _plausible_prefix(bytes(self._buf[:32])):
                self._result = SniffError(Reason.PROTOCOL_UNRECOGNISED, "not an HTTP request")
                return self._result
            return NEED_MORE
        if end + 4 > self.max_bytes:
            self._result = SniffError(Reason.HEAD_TOO_LARGE, "request head exceeds the cap")
        else:
            self._result = parse_head(bytes(self._buf[: end + 4]))
        return self._result


def _plausible_prefix(prefix: bytes) -> bool:
    """Reject early (before the deadline) what can never become a request line."""
    method, sep, _ = prefix.partition(b" ")
    if not sep:
        return method == b"" or _METHOD.fullmatch(method) is not None
    return _METHOD.fullmatch(method) is not None


def looks_like_http(first: bytes) -> bool:
    return len(first) >= 1 and 0x41 <= first[0] <= 0x5A  # an upper-case method letter


_HOP_BY_HOP_CONNECTION = frozenset({"connection", "keep-alive", "proxy-connection"})


def force_close(head: RequestHead, data: bytes) -> bytes:
    """`data` (head + whatever followed) with the head rewritten to `Connection: close`.

    Only the first request of a plain-HTTP connection is inspected, so the upstream must
    not serve a second one (which could name another Host on a shared server): any
    Connection / Keep-Alive / Proxy-Connection header is dropped and `Connection: close`
    added. Pure; the request line and every other header stay byte for byte.
    """
    lines = data[: head.head_len - 4].split(b"\r\n")
    kept = [lines[0]] + [
        line
        for line in lines[1:]
        if line.partition(b":")[0].decode("latin-1").lower() not in _HOP_BY_HOP_CONNECTION
    ]
    kept.append(b"Connection: close")
    return b"\r\n".join(kept) + b"\r\n\r\n" + data[head.head_len :]


_DIGITS = frozenset("0123456789")
# methods whose requests carry no content (RFC 9110 9.3.1-2): a body on one would pass a
# rule that allows only them ("read-only") with an upload inside
BODYLESS_METHODS = frozenset({"GET", "HEAD"})


def body_length(head: RequestHead) -> int | None:
    """The length of the request body that follows `head`, from its framing headers; None
    when it is not a plain Content-Length the gateway can count (Transfer-Encoding, with
    or without Content-Length, or Content-Length values that are not one decimal number).
    No Content-Length and no Transfer-Encoding: no body (RFC 9112 6.3)."""
    lengths: set[str] = set()
    for name, value in head.headers:
        n = name.lower()
        if n == "transfer-encoding":
            return None
        if n == "content-length":
            for part in value.split(","):
                v = part.strip()
                if not v or not set(v) <= _DIGITS or len(v) > 15:
                    return None
                lengths.add(v.lstrip("0") or "0")
    if len(lengths) > 1:
        return None
    return int(lengths.pop()) if lengths else 0
