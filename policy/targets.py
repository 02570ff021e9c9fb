"""Turn a policy-test or `explain` TARGET (a URL or `host:port`) into RequestFacts.

Malformed authorities are passed through raw so that `decide` refuses them with
`invalid_host`, exactly as the gateway would: explain shows what enforcement does.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .hosts import HostError, split_host_port
from .model import RequestFacts

_DEFAULT_PORT = {"https": 443, "http": 80}


class TargetError(ValueError):
    pass


def parse_target(target: str, method: str | None = None) -> RequestFacts:
    """URL -> host, port (scheme default), path, method (default GET: a URL implies a request).
    `host:port` (port default 443) -> an L4 flow; method/path only if `method` is given."""
    if "://" in target:
        scheme, _, rest = target.partition("://")
        scheme = scheme.lower()
        if scheme not in _DEFAULT_PORT:
            raise TargetError(f"unsupported URL scheme {scheme!r} (use http or https)")
        # the authority ends at the first '/', '?' or '#'; userinfo stays in (fails closed)
        end = min((i for i in (rest.find(c) for c in "/?#") if i != -1), default=len(rest))
        authority = rest[:end]
        split = urlsplit("//placeholder" + rest[end:])
        path = split.path or "/"
        if split.query:
            path += "?" + split.query
        host, port = _split(authority, _DEFAULT_PORT[scheme])
        return RequestFacts(host=host, port=port, method=(method or "GET").upper(), path=path)
    host, port = _split(target, 443)
    if method is None:
        return RequestFacts(host=host, port=port)
    return RequestFacts(host=host, port=port, method=method.upper(), path="/")


def _split(authority: str, default_port: int) -> tuple[str, int]:
    try:
        return split_host_port(authority, default_port)
    except HostError:
        if authority.rpartition(":")[2].isdigit() and not authority.endswith("]"):
            host, _, port = authority.rpartition(":")
            if 1 <= int(port) <= 65535:
                return host, int(port)
        return authority, default_port
