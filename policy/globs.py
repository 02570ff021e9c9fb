"""URL path globs for `http.paths` and broker operations.

Hand-written because fnmatch lets `*` cross `/`, which turns `/repos/*/issues` into
`/repos/a/b/c/issues`. Here `*` and `?` stay inside one path segment and `**` spans
segments. Paths that could mean something else to the upstream (dot segments, encoded
slashes or dots, backslashes) never match: fail closed.
"""

from __future__ import annotations

import re
from functools import lru_cache

_AMBIGUOUS = re.compile(r"(?:^|/)\.\.?(?:/|$)|%2[ef]|%5c|\\|//", re.IGNORECASE)


class GlobError(ValueError):
    pass


@lru_cache(maxsize=4096)
def compile_glob(pattern: str) -> re.Pattern[str]:
    """Regex for a path glob; raises GlobError for patterns that do not start with '/'."""
    if not pattern.startswith("/"):
        raise GlobError("path glob must start with '/'")
    if any(c.isspace() or ord(c) < 0x20 for c in pattern):
        raise GlobError("path glob must not contain whitespace or control characters")
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def request_path(path: str) -> str | None:
    """The part of a request target that globs see (no query/fragment); None = ambiguous."""
    p = path.split("?", 1)[0].split("#", 1)[0]
    if not p.startswith("/") or _AMBIGUOUS.search(p):
        return None
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in p):
        return None
    return p


def path_matches(patterns: tuple[str, ...], path: str) -> bool:
    """Does the request path match any glob? A trailing '/' on the request is optional."""
    p = request_path(path)
    if p is None:
        return False
    stripped = p.rstrip("/") or "/"
    for pat in patterns:
        rx = compile_glob(pat)
        if rx.fullmatch(p) or rx.fullmatch(stripped):
            return True
    return False
