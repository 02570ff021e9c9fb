"""Sans-IO checks of a caller's request and the upstream URL built from it.

Hand-written because the rules are ours, not HTTP's: a caller may choose the path, query,
method, body and ordinary headers of an upstream call, never its host, scheme, port or
credentials. Everything here is pure (strings in, `CallRequest` or `RequestError` out)
so it is unit- and property-tested without sockets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, unquote_plus, urlsplit

from stockade.policy.model import ApiDefinition, Injection


class RequestError(ValueError):
    """The request is malformed or tries to escape the API definition (400 bad_request)."""


METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

# RFC 9110 7.6.1 plus the proxy-era ones; never forwarded in either direction
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# headers the broker owns on the upstream request; a caller's value is dropped
OWNED_REQUEST = frozenset(
    {
        "host",
        "authorization",
        "cookie",
        "content-length",
        "accept-encoding",
        "x-api-key",
        "api-key",
        "x-auth-token",
        "private-token",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "x-real-ip",
        "expect",
        # a byte range of an answer that echoes the key holds a piece of it the scrubber
        # cannot know for the key's, and the next range the next piece: the answer is
        # always whole (a client that asked for a range handles a 200, RFC 9110 14.2)
        "range",
        "if-range",
    }
)
# headers the broker recomputes on the way back (the body is scrubbed and re-framed)
OWNED_RESPONSE = frozenset({"content-length", "content-encoding", "set-cookie", "alt-svc"})
_DROPPED = HOP_BY_HOP | OWNED_REQUEST
_DROPPED_RESPONSE = HOP_BY_HOP | OWNED_RESPONSE

# RFC 9110 token; use fullmatch: a "$" anchor would let "x\n" through
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # CR, LF, NUL and other controls
_PCT = re.compile(r"%([0-9A-Fa-f]{2})")
# a path of only unreserved and sub-delim characters (no "%", "?", "#", "\", spaces or
# controls): `check_path` has nothing to decode or re-quote in it (the per-call case)
_PLAIN_PATH = re.compile(r"(?:/[A-Za-z0-9._~!$&'()*+,;=:@-]*)+")
_BAD_PCT = re.compile(r"%(?![0-9A-Fa-f]{2})")
MAX_PATH = 8192
MAX_HEADERS = 100


@dataclass(frozen=True, slots=True)
class CallRequest:
    """A validated call: everything the policy check and the upstream call need."""

    api: str
    method: str
    path: str  # as sent upstream (percent-encoded), always starts with "/"
    match_path: str  # percent-decoded, for operation globs
    query: tuple[str, ...]  # percent-encoded "name=value" parts
    headers: tuple[tuple[str, str], ...]  # already filtered
    body: bytes


def check_method(method: str) -> str:
    m = method.upper()
    if m not in METHODS:
        raise RequestError("unsupported method")
    return m


def check_path(raw: str) -> tuple[str, str]:
    """Return (encoded path, decoded path) or raise RequestError.

    Refuses anything that could move the request off the API's base path or host:
    absolute and scheme-relative URLs, dot segments (also percent-encoded), encoded
    slashes and backslashes, NUL/controls, malformed escapes.
    """
    if not raw:
        raw = "/"
    if len(raw) > MAX_PATH:
        raise RequestError("path too long")
    if (_PLAIN_PATH.fullmatch(raw) and "/." not in raw and "://" not in raw
            and not raw.startswith("//")):
        # no escapes, no dot segment, nothing to quote: the checks below would all pass
        # and both forms equal `raw` (the property test compares the two paths)
        return raw, raw
    return _check_path_slow(raw)


def _check_path_slow(raw: str) -> tuple[str, str]:
    _check_path_chars(raw)
    _check_path_escapes(raw)
    decoded = _decode_path(raw)
    # re-quote what is not already safe, keeping existing escapes and the "/" structure
    encoded = quote(raw, safe="/%:@!$&'()*+,;=-._~")
    return encoded, decoded


def _check_path_chars(raw: str) -> None:
    if not raw.startswith("/") or raw.startswith("//"):
        raise RequestError("path must be absolute-path form, not a URL")
    if "://" in raw or "\\" in raw or "?" in raw or "#" in raw:
        raise RequestError("path contains a URL, backslash, query or fragment")
    if _BAD_VALUE.search(raw) or "\t" in raw or " " in raw:
        raise RequestError("path contains whitespace or control characters")


def _check_path_escapes(raw: str) -> None:
    if _BAD_PCT.search(raw):
        raise RequestError("malformed percent-escape in path")
    for m in _PCT.finditer(raw):
        b = int(m.group(1), 16)
        # encoded "/", "\" and controls would be decoded by some upstream into a new
        # segment or header; encoded "." is only dangerous in dot segments (checked below)
        if b in (0x2F, 0x5C) or b < 0x20 or b == 0x7F:
            raise RequestError("encoded slash, backslash or control in path")


def _decode_path(raw: str) -> str:
    """The percent-decoded path; a dot segment in either form is refused."""
    try:
        decoded = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise RequestError("path is not UTF-8") from None
    for seg in decoded.split("/"):
        if seg in (".", ".."):
            raise RequestError("dot segment in path")
    for seg in raw.split("/"):
        if seg in (".", ".."):
            raise RequestError("dot segment in path")
    return decoded


def check_header(name: str, value: str) -> None:
    if not _TOKEN.fullmatch(name):
        raise RequestError("invalid header name")
    if _BAD_VALUE.search(value):
        raise RequestError("control character (CR/LF/NUL) in header value")


def filter_headers(
    headers: Iterable[tuple[str, str]], injection: Injection | None = None
) -> tuple[tuple[str, str], ...]:
    """Drop hop-by-hop, host, credential and broker-owned headers; reject CRLF/NUL.

    The header an injection writes (e.g. X-Api-Key) is dropped too, so the caller can
    neither override nor duplicate the injected credential.
    """
    items = list(headers)
    if len(items) > MAX_HEADERS:
        raise RequestError("too many headers")
    own = injection.header.lower() if injection is not None and injection.header else None
    names = [n for n, _ in items]
    _check_headers(items, names)
    lows = [n.lower() for n in names]
    # a Connection header may name further hop-by-hop headers
    conn_named = (_connection_named(zip(lows, (v for _, v in items), strict=True))
                  if "connection" in lows else set())
    return tuple(item for low, item in zip(lows, items, strict=True)
                 if not (low in _DROPPED or low == own or low in conn_named
                         or low.startswith("proxy-") or low.startswith("x-stockade-")))


def _check_headers(items: list[tuple[str, str]], names: list[str]) -> None:
    # one search over all names and all values first (nearly always clean); a bad
    # header sends us through the per-header checks for the precise error
    if (not all(names) or not _TOKEN.fullmatch("".join(names))
            or _BAD_VALUE.search("".join(v for _, v in items))):
        for name, value in items:
            check_header(name, value)


def _connection_named(lowered: Iterable[tuple[str, str]]) -> set[str]:
    """The header names the Connection headers among (lower-cased name, value) list."""
    named: set[str] = set()
    for low, value in lowered:
        if low == "connection":
            named.update(t.strip().lower() for t in value.split(",") if t.strip())
    return named


def filter_response_headers(
    headers: Iterable[tuple[str, str]],
) -> list[tuple[str, str]]:
    items = [(n.lower(), n, v) for n, v in headers]
    conn_named = _connection_named((low, v) for low, _, v in items)
    return [
        (n, v)
        for low, n, v in items
        if low not in _DROPPED_RESPONSE and low not in conn_named and not _BAD_VALUE.search(v)
    ]


LINK_HEADERS = frozenset({"location", "content-location", "link"})


def rewrite_links(
    headers: Iterable[tuple[str, str]], base_url: str, broker_prefix: str
) -> list[tuple[str, str]]:
    """Point upstream self-links (redirects, `Link: <...>; rel="next"` pagination) back at
    the broker, so a pass-through SDK keeps calling through it instead of the API host
    (which the gateway would refuse). Only the exact base URL prefix is rewritten."""
    base = base_url.rstrip("/")
    out = []
    for name, value in headers:
        if name.lower() in LINK_HEADERS and base in value:
            value = re.sub(re.escape(base) + r"(?=[/?#>;,\s]|$)", broker_prefix, value)
        out.append((name, value))
    return out


def parse_query(raw: str) -> tuple[str, ...]:
    """Split a raw query string into its `name=value` parts, keeping the caller's encoding.

    Kept verbatim (not decoded and re-encoded) so "+" and escapes mean to the upstream
    exactly what the SDK meant; only controls, spaces, "#" and broken escapes are refused.
    """
    if not raw:
        return ()
    if _BAD_VALUE.search(raw) or "#" in raw or " " in raw or "\t" in raw:
        raise RequestError("control character, space or fragment in query")
    if _BAD_PCT.search(raw):
        raise RequestError("malformed percent-escape in query")
    return tuple(part for part in raw.split("&") if part)


def encode_query(pairs: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """Encode decoded (name, value) pairs as query parts."""
    out = []
    for name, value in pairs:
        if _BAD_VALUE.search(name) or _BAD_VALUE.search(value):
            raise RequestError("control character in query")
        out.append(f"{quote(name, safe='')}={quote(value, safe='')}")
    return tuple(out)


def query_name(part: str) -> str:
    """The decoded name of one query part (for dropping a caller's copy of the key param)."""
    return unquote_plus(part.partition("=")[0])


def normalize_query(
    query: Mapping[str, object] | Iterable[object] | None,
) -> tuple[str, ...]:
    """Accept the JSON call style's query: {"a": "1", "b": ["2", "3"]} or [["a", "1"]]."""
    if query is None:
        return ()
    pairs: list[tuple[str, str]] = []
    if isinstance(query, Mapping):
        for k, v in query.items():
            vals = v if isinstance(v, list) else [v]
            for item in vals:
                if not isinstance(item, str | int | float | bool):
                    raise RequestError("query values must be scalars")
                pairs.append((str(k), _scalar(item)))
    elif not isinstance(query, list | tuple):
        raise RequestError("query must be an object or a list of [name, value]")
    else:
        for pair in query:
            if not (isinstance(pair, list | tuple) and len(pair) == 2):
                raise RequestError("query must be an object or a list of [name, value]")
            if not isinstance(pair[1], str | int | float | bool):
                raise RequestError("query values must be scalars")
            pairs.append((str(pair[0]), _scalar(pair[1])))
    return encode_query(pairs)


def _scalar(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


CALL_KEYS = frozenset({"api", "method", "path", "query", "headers", "body", "json"})


def parse_passthrough(
    raw_target: str,
    method: str,
    headers: Iterable[tuple[str, str]],
    apis: Mapping[str, ApiDefinition],
) -> CallRequest:
    """`/{api}/{path...}?{query}` as sent by an SDK whose base URL is the broker; the body
    is read later (only once the call is authorized)."""
    if not raw_target.startswith("/"):
        raise RequestError("absolute-form request target refused")
    raw_path, _, raw_query = raw_target.partition("?")
    api_name = raw_path[1:].partition("/")[0]
    if not api_name:
        raise RequestError("no API name in the path")
    if "%" in api_name:
        raise RequestError("API name must not be percent-encoded")
    m = check_method(method)
    path, decoded = check_path(raw_path[len(api_name) + 1:] or "/")
    query = parse_query(raw_query)
    api = apis.get(api_name)
    kept = filter_headers(headers, api.injection if api else None)
    return CallRequest(api_name, m, path, decoded, query, kept, b"")


def parse_call_doc(doc: Any, apis: Mapping[str, ApiDefinition]) -> CallRequest:
    """A `/v1/call` document {api, method, path, query, headers, body | json}."""
    if not isinstance(doc, dict):
        raise RequestError("body must be a JSON object")
    unknown = set(doc) - CALL_KEYS
    if unknown:
        raise RequestError("unknown keys: " + ", ".join(sorted(unknown)))
    api_name = doc.get("api")
    if not isinstance(api_name, str) or not api_name:
        raise RequestError("api must be a string")
    method = check_method(str(doc.get("method", "GET")))
    raw_path = doc.get("path", "/")
    if not isinstance(raw_path, str):
        raise RequestError("path must be a string")
    path, decoded = check_path(raw_path)
    query = normalize_query(doc.get("query"))
    api = apis.get(api_name)
    headers = filter_headers(_doc_headers(doc.get("headers") or {}),
                             api.injection if api else None)
    headers, body = _doc_body(doc, headers)
    return CallRequest(api_name, method, path, decoded, query, headers, body)


def _doc_headers(hdrs: Any) -> Iterable[tuple[str, str]]:
    if not isinstance(hdrs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in hdrs.items()
    ):
        raise RequestError("headers must be an object of strings")
    return hdrs.items()


def _doc_body(
    doc: dict[str, Any], headers: tuple[tuple[str, str], ...]
) -> tuple[tuple[tuple[str, str], ...], bytes]:
    """The body as bytes: `json` is serialised (Content-Type added when the caller gave
    none), `body` must be a string."""
    if "body" in doc and "json" in doc:
        raise RequestError("give body or json, not both")
    if "json" in doc:
        body = json.dumps(doc["json"], separators=(",", ":")).encode()
        if not any(k.lower() == "content-type" for k, _ in headers):
            headers = (*headers, ("Content-Type", "application/json"))
        return headers, body
    b = doc.get("body")
    if b is not None and not isinstance(b, str):
        raise RequestError("body must be a string (use json for structured data)")
    return headers, (b or "").encode("utf-8")


@dataclass(frozen=True, slots=True)
class Upstream:
    scheme: str
    host: str
    port: int
    prefix: str  # base path without trailing "/"


def parse_base_url(api: ApiDefinition) -> Upstream:
    parts = urlsplit(api.base_url)
    if parts.scheme not in ("https", "http") or (
        parts.scheme == "http" and not api.allow_plain_http
    ):
        raise RequestError("API base_url must be https (or http with allow_plain_http)")
    if not parts.hostname or parts.username or parts.password or parts.query or parts.fragment:
        raise RequestError("API base_url must be scheme://host[:port][/prefix]")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Upstream(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))


def build_url(up: Upstream, path: str, query: Iterable[str]) -> str:
    """The upstream URL: scheme, host and port only ever come from the definition."""
    host = f"[{up.host}]" if ":" in up.host else up.host
    default = 443 if up.scheme == "https" else 80
    authority = host if up.port == default else f"{host}:{up.port}"
    url = f"{up.scheme}://{authority}{up.prefix}{path}"
    q = "&".join(query)
    return f"{url}?{q}" if q else url
