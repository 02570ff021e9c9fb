"""'did you mean' hints for a misspelt key, profile, preset or API name (difflib)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_to(word: str, known: Iterable[str]) -> list[str]:
    """The known names that look like `word`, closest first (at most three)."""
    return difflib.get_close_matches(word, sorted(set(known)), n=3, cutoff=0.6)


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """'; did you mean 'x'?' (or 'x' or 'y'), or '' when nothing is close."""
    near = close_to(word, known)
    if not near:
        return ""
    return "; did you mean " + " or ".join(repr(n) for n in near) + "?"

