"""Label-shape signals: does a DNS label look like encoded data rather than a word?

Entropy misses the encodings tunnels use: hex carries at most 4 bits per character and
stays under the entropy threshold at any length; short base32 labels are below the
entropy guard's minimum length. These checks look at the alphabet instead. A match only
puts the name under the lower `encoded_names_per_window` budget; it refuses nothing by
itself, so a CDN hash label costs one slot of that budget, not a denial.

Hand-written: a few set comparisons on short ASCII strings; no library classifies DNS
labels. Names arrive normalised (lower case), so base64's case is already folded: what
stays visible is letters and digits alternating, which words and host names rarely do.
"""

from __future__ import annotations

import itertools
import string
from enum import StrEnum

DIGIT_RUN = 6  # this many consecutive digits in any label is encoded-looking (numbers, ids)
BASE64_SWITCHES = 4  # letter<->digit alternations that mark a base64/base36 label

_HEX = frozenset("0123456789abcdef")
_BASE32 = frozenset(string.ascii_lowercase + "234567")  # RFC 4648 alphabet, lower-cased
_BASE64URL = frozenset(string.ascii_lowercase + string.digits + "-_")
_DIGITS = frozenset(string.digits)


class Shape(StrEnum):
    HEX = "hex"
    BASE32 = "base32"
    BASE64 = "base64"
    DIGITS = "digits"


def _longest_digit_run(label: str) -> int:
    best = run = 0
    for c in label:
        run = run + 1 if c in _DIGITS else 0
        best = max(best, run)
    return best


def _switches(label: str) -> int:
    """Adjacent letter/digit pairs (either order; `-` and `_` separate, they do not count)."""
    return sum(
        1
        for a, b in itertools.pairwise(label)
        if a.isalnum() and b.isalnum() and (a in _DIGITS) != (b in _DIGITS)
    )


def label_shape(label: str, min_length: int) -> Shape | None:
    """The encoding `label` looks like, or None. Labels shorter than `min_length` are
    judged only on digit runs."""
    lab = label.lower()
    if _longest_digit_run(lab) >= DIGIT_RUN:
        return Shape.DIGITS
    if len(lab) < min_length:
        return None
    chars = set(lab)
    if chars <= _HEX:
        return Shape.HEX
    has_digit = not chars.isdisjoint(_DIGITS)
    if chars <= _BASE32 and has_digit:
        return Shape.BASE32
    if chars <= _BASE64URL and _switches(lab) >= BASE64_SWITCHES:
        return Shape.BASE64
    return None


def name_shape(name: str, min_length: int) -> Shape | None:
    """The first encoded-looking label's shape among `name`'s labels, or None."""
    for label in name.split("."):
        shape = label_shape(label, min_length)
        if shape is not None:
            return shape
    return None
