"""URL path globs for `http.paths` and broker operations.

Hand-written because fnmatch lets `*` cross `/`, which turns `/repos/*/issues` into
`/repos/a/b/c/issues`. Here `*` and `?` stay inside one path segment and `**` spans
segments. Paths that could mean something else to the upstream (dot segments, encoded
slashes or dots, backslashes, ';' parameters, double or overlong encodings, fragments,
non-ASCII) never match: fail closed (see `request_path`).
"""

from __future__ import annotations

import re
from functools import lru_cache

_AMBIGUOUS = re.compile(r"(?:^|/)\.\.?(?:/|$)|\\|//|;", re.IGNORECASE)
_PCT = re.compile(r"%(.?.?)")
# what a percent-encoding may not decode to: anything that changes how the path splits
# into segments or decodes again (/ \ . ; % # ?), controls and non-ASCII (%c0%ae, an
# overlong '.', and every other byte >= 0x80)
_PCT_FORBIDDEN = frozenset(b"/\\.;%#?")

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
    """The part of a request target that globs see (no query); None = ambiguous.

    Ambiguous (never matches any glob, fail closed): a fragment ('#' cannot be in a
    request target; cutting at it would let `/ok/#/../../x` match `/ok/**`), dot
    segments, empty segments, backslashes, ';' path parameters (`/ok/..;/x` is `/x` to
    some servers), anything outside printable ASCII, a '%' not followed by two hex digits
    (`%u002e`), and a percent-encoding that decodes to a structural character (/ \\ . ;
    % # ?), a control or a byte >= 0x80 (`%2e%2e`, `%252e`, `%c0%ae`).
    """
    if not isinstance(path, str) or "#" in path:
        return None
    p = path.split("?", 1)[0]
    if not p.startswith("/") or _AMBIGUOUS.search(p):
        return None
    if any(ord(c) < 0x21 or ord(c) > 0x7E for c in p):
        return None
    for m in _PCT.finditer(p):
        hx = m.group(1)
        if len(hx) != 2 or not all(c in "0123456789abcdefABCDEF" for c in hx):
            return None
        b = int(hx, 16)
        if b < 0x20 or b > 0x7E or b in _PCT_FORBIDDEN:
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
