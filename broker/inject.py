"""Sans-IO credential injection: where the secret goes on the upstream request.

Pure: (injection style, secret) in, headers and query pairs out. `rendered_values`
lists every string that carries the secret on the wire, so the scrubber can also look
for the rendered form (e.g. base64 of "user:secret" for basic auth).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from stockade.policy.model import Injection

from .request import RequestError, check_header, query_name


@dataclass(frozen=True, slots=True)
class Injected:
    headers: tuple[tuple[str, str], ...]
    query: tuple[tuple[str, str], ...]  # decoded (name, value); encode_query() them
    rendered_values: tuple[str, ...]  # the exact strings sent (header values / query values)


def inject(injection: Injection, secret: str) -> Injected:
    if not secret:
        raise RequestError("empty credential")
    if injection.style == "bearer":
        value = f"Bearer {secret}"
        check_header("Authorization", value)
        return Injected((("Authorization", value),), (), (value,))
    if injection.style == "header":
        name = injection.header or "X-Api-Key"
        template = injection.template or "{secret}"
        # str.replace, not str.format: a template must not reach attributes or indexes
        value = template.replace("{secret}", secret)
        check_header(name, value)
        return Injected(((name, value),), (), (value,))
    if injection.style == "basic":
        user = injection.username or ""
        token = base64.b64encode(f"{user}:{secret}".encode()).decode("ascii")
        value = f"Basic {token}"
        return Injected((("Authorization", value),), (), (value, token))
    if injection.style == "query":
        param = injection.query_param or "key"
        return Injected((), ((param, secret),), (secret,))
    raise RequestError(f"unknown injection style {injection.style!r}")


def strip_injected_query(query: tuple[str, ...], injection: Injection) -> tuple[str, ...]:
    """A caller must not supply (or duplicate) the query parameter that carries the key."""
    if injection.style != "query":
        return query
    param = injection.query_param or "key"
    return tuple(part for part in query if query_name(part) != param)
