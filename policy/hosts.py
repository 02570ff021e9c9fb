"""Host name normalisation: one function used when loading rules and when matching requests.

Hand-written (around the `idna` package) because the security property lives in what it
*refuses*: Smokescreen's trailing-dot/case and `[host]` bypasses came from rule and request
names being compared in different forms. Every name is brought to one canonical form
(lower case, no trailing dot, punycode A-labels) or rejected; IP literals come back in
their canonical text form so name rules can never match them.
"""

from __future__ import annotations

import ipaddress
import re
from functools import lru_cache

import idna

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_NAME = 253  # RFC 1035 limit on the presentation form without the trailing dot
MAX_LABEL = 63
MAX_RAW = 1024  # anything longer is refused before any parsing work

# characters that are never part of a host and signal an authority/userinfo/URL trick
_FORBIDDEN = re.compile(r"[\[\]@\s\x00-\x1f\x7f-\x9f/\\?#%\u200b-\u200f\u2028\u2029\ufeff]")
# after lower-casing: letters, digits, hyphen, underscore (seen in real CDN names), dots
_NOT_LDH = re.compile(r"[^a-z0-9_.-]")


class HostError(ValueError):
    """A host name or pattern that cannot be normalised; requests with it fail closed."""


def normalize_host(raw: str) -> str:
    """Canonical form of a request or rule host name; raises HostError.

    Lower case, one trailing dot removed, IDNA (UTS-46, non-transitional) to punycode.
    Refuses brackets, `@`, whitespace, control characters, empty labels, over-long names
    and numeric shorthand that resolvers read as an IPv4 address (`127.1`, `0x7f.1`).
    IP literals (without brackets) are returned in canonical form.
    """
    if not isinstance(raw, str):
        raise HostError("host must be a string")
    return _normalize(raw)


def _normalize_raw(raw: str) -> str:
    if not raw:
        raise HostError("empty host")
    if len(raw) > MAX_RAW:
        raise HostError("host name too long")
    if ":" in raw:
        return _ip6_literal(raw)
    if raw.isascii():
        name = raw.lower()
    else:
        _refuse(_FORBIDDEN, raw)
        name = _to_ascii(raw)
    # one character-class scan instead of a full-name regex: this runs per request
    _refuse(_NOT_LDH, name)
    if name.endswith("."):
        name = name[:-1]
    _check_shape(name)
    last = name.rpartition(".")[2]
    if last.isdigit() or (last.startswith("0x") and _is_hex(last[2:])):
        try:
            return str(ipaddress.IPv4Address(name))
        except ValueError:
            raise HostError("numeric host that is not a dotted-quad IPv4 address") from None
    if "xn--" in name:
        _check_alabels(name)
    return name


def _refuse(chars: re.Pattern[str], text: str) -> None:
    bad = chars.search(text)
    if bad:
        raise HostError(f"host contains forbidden character {bad.group()!r}")


def _ip6_literal(raw: str) -> str:
    """A host with ':' can only be an IP (v6) literal; canonical text or HostError."""
    _refuse(_FORBIDDEN, raw)
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        raise HostError("host contains ':' but is not an IP address") from None


def _check_shape(name: str) -> None:
    """Length and label rules of an LDH name (lower case, trailing dot already removed)."""
    if not name:
        raise HostError("empty host")
    if len(name) > MAX_NAME:
        raise HostError(f"host name longer than {MAX_NAME} characters")
    # substring tests run in C; a per-label Python loop would dominate the request path
    if ".." in name or name[0] == "." or name[-1] == ".":
        raise HostError("empty label in host name")
    if name[0] == "-" or name[-1] == "-" or ".-" in name or "-." in name:
        raise HostError("a label must not start or end with '-'")
    if len(name) > MAX_LABEL and max(map(len, name.split("."))) > MAX_LABEL:
        raise HostError(f"label longer than {MAX_LABEL} characters")


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


_normalize = lru_cache(maxsize=8192)(_normalize_raw)


def _to_ascii(raw: str) -> str:
    try:
        mapped = idna.uts46_remap(raw, std3_rules=False, transitional=False)
    except (idna.IDNAError, UnicodeError, ValueError) as e:
        raise HostError(f"invalid international name: {e}") from None
    # the mapping can produce characters the raw check did not see (fullwidth commercial at -> '@')
    _refuse(_FORBIDDEN, mapped)
    trailing = mapped.endswith(".")
    labels = (mapped[:-1] if trailing else mapped).split(".")
    out = []
    for label in labels:
        if not label:
            raise HostError("empty label in host name")
        if label.isascii():
            out.append(label.lower())
            continue
        try:
            out.append(idna.alabel(label).decode("ascii"))
        except (idna.IDNAError, UnicodeError, ValueError) as e:
            raise HostError(f"invalid international label: {e}") from None
    return ".".join(out)


def _check_alabels(name: str) -> None:
    for label in name.split("."):
        if label.startswith("xn--"):
            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError, ValueError):
                raise HostError(f"invalid punycode label {label!r}") from None


@lru_cache(maxsize=8192)
def classify_host(raw: str) -> tuple[str | None, IPAddress | None]:
    """(name, None) for a host name or (None, address) for an IP literal; HostError else.

    Cached: the gateway asks about the same few hosts over and over."""
    if not isinstance(raw, str):
        raise HostError("host must be a string")
    host = _normalize_raw(raw)  # this function's own cache covers it
    if is_ip_literal(host):
        return None, ipaddress.ip_address(host)
    return host, None


def is_ip_literal(host: str) -> bool:
    """True when a normalised host is an IP address (so name rules never apply)."""
    if ":" in host:
        return True
    last = host.rpartition(".")[2]
    return last.isdigit() or (last.startswith("0x") and _is_hex(last[2:]))


def normalize_pattern(raw: str) -> str:
    """Canonical form of a rule's host pattern: a name, or `*.` + name (subdomains only)."""
    if not isinstance(raw, str):
        raise HostError("host pattern must be a string")
    wildcard = raw.startswith("*.")
    body = raw[2:] if wildcard else raw
    if "*" in body:
        raise HostError(
            "'*' is only allowed as the whole first label of a pattern ('*.example.com')"
        )
    host = normalize_host(body)
    if is_ip_literal(host):
        raise HostError("IP address in a host pattern; use 'cidr:' for addresses")
    if wildcard and "." not in host:
        raise HostError("wildcard over a top-level domain is too broad")
    return "*." + host if wildcard else host


def split_host_port(authority: str, default_port: int) -> tuple[str, int]:
    """Split `host:port` / `[v6]:port` / `host`; the host is returned raw (not normalised).

    Brackets are removed only around a valid IPv6 literal, so `[evil.com]` stays invalid.
    Userinfo is kept in the host so that `user@host` fails normalisation (fail closed).
    """
    if authority.startswith("["):
        end = authority.find("]")
        if end == -1:
            raise HostError("unclosed '[' in authority")
        inner, rest = authority[1:end], authority[end + 1 :]
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise HostError("brackets around something that is not an IPv6 address") from None
        host = inner
    elif authority.count(":") > 1:
        return authority, default_port  # a bare IPv6 literal; normalisation canonicalises it
    else:
        host, sep, port_s = authority.partition(":")
        rest = sep + port_s
    if not rest:
        return host, default_port
    if not rest.startswith(":") or not rest[1:].isdigit():
        raise HostError("invalid port in authority")
    port = int(rest[1:])
    if not 1 <= port <= 65535:
        raise HostError("port outside 1..65535")
    return host, port
