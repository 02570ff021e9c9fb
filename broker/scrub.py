"""Streaming removal of a secret, in every encoding an upstream might echo it in.

Hand-written because no library scrubs a byte stream for a known set of values: an
upstream that echoes the request (httpbin style) returns the injected key raw, inside
the rendered header, base64'd (at any of the 3 byte alignments inside a longer string),
URL-encoded, hex'd, JSON-escaped or UTF-16. Base64 may be wrapped (MIME at 76
characters, PEM at 64): a line break, raw or JSON-escaped, may fall anywhere inside a
base64 form. The streaming form holds back `longest pattern - 1` bytes between chunks
(lines wrapped at 64 or more characters counted in) so a secret split across chunk
boundaries is still caught.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, quote_plus

REDACTED = b"[REDACTED]"
MIN_DERIVED = 6  # shorter derived forms would redact ordinary text by accident
# a line break that wrapped base64 may carry between any two of its characters
WRAP = rb"(?:\r?\n|(?:\\r)?\\n)?"
WRAP_MIN = 64  # the narrowest common wrap (PEM): sizes the stream's hold-back
WRAP_MAX_BYTES = 4  # one break's longest form, JSON-escaped `\r\n`


def _b64_cores(data: bytes) -> set[bytes]:
    """Base64 fragments that appear whenever `data` sits anywhere in a base64'd string.

    For each alignment k (bytes before `data` modulo 3), the characters that depend only
    on `data`'s bytes: drop the leading ones mixed with the unknown prefix and the trailing
    one mixed with unknown following bytes (and the padding).
    """
    out: set[bytes] = set()
    n = len(data)
    for k in range(3):
        skip = (k * 8 + 5) // 6  # characters touched by the k unknown prefix bytes
        end = (8 * (k + n)) // 6  # characters fully determined by prefix + data
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            full = enc(b"\x00" * k + data)
            core = full[skip:end]
            if core:
                out.add(core)
    return out


def forms(value: str) -> set[bytes]:
    """Every byte string under which `value` (or part of an encoding of it) is recognised."""
    raw = value.encode("utf-8")
    derived: set[bytes] = set()
    derived |= _b64_cores(raw)
    derived.add(value.encode("utf-16-le"))
    derived.add(value.encode("utf-16-be"))
    derived.add(raw.hex().encode())
    derived.add(raw.hex().upper().encode())
    for q in (quote(value, safe=""), quote_plus(value, safe="")):
        derived.add(q.encode())
        derived.add(re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), q).encode())
    for ascii_only in (True, False):
        j = json.dumps(value, ensure_ascii=ascii_only)[1:-1]
        derived.add(j.encode("utf-8"))
        derived.add(j.replace("/", "\\/").encode("utf-8"))
    out = {raw}
    out |= {d for d in derived if len(d) >= MIN_DERIVED}
    return out


def _wrapped(core: bytes) -> bytes:
    """A base64 core as a pattern that also matches it with line breaks inside."""
    return WRAP.join(re.escape(core[i:i + 1]) for i in range(len(core)))


@dataclass(frozen=True)
class Patterns:
    """A compiled set of forms; build once per (secret, rendered values), share freely."""

    regex: re.Pattern[bytes]
    max_len: int

    @staticmethod
    def build(values: Iterable[str]) -> Patterns:
        pats: set[bytes] = set()
        cores: set[bytes] = set()
        for v in values:
            if v:
                pats |= forms(v)
                cores |= {c for c in _b64_cores(v.encode("utf-8")) if len(c) >= MIN_DERIVED}
        if not pats:
            raise ValueError("no values to scrub")
        ordered = sorted(pats, key=lambda p: (-len(p), p))  # longest first at one position
        wrapped = [_wrapped(c) for c in sorted(cores, key=lambda c: (-len(c), c))]
        rx = re.compile(b"|".join([re.escape(p) for p in ordered] + wrapped))
        longest_core = max((len(c) for c in cores), default=0)
        wrapped_len = longest_core + WRAP_MAX_BYTES * (longest_core // WRAP_MIN + 1)
        return Patterns(rx, max(wrapped_len, *(len(p) for p in ordered)))

    def scrub(self, data: bytes) -> tuple[bytes, int]:
        """One-shot scrub (header values, whole bodies): (clean bytes, replacements)."""
        out, n = self.regex.subn(REDACTED, data)
        return out, n

    def scrub_text(self, text: str) -> tuple[str, int]:
        out, n = self.scrub(text.encode("utf-8", "surrogateescape"))
        return out.decode("utf-8", "surrogateescape"), n

    def scrub_texts(self, texts: list[str]) -> tuple[list[str], int]:
        """`scrub_text` over several values (a response's headers): one search over all of
        them first, since nearly always nothing matches. Any match inside one value is
        also a match in the joined text, so a miss there means a miss in every value."""
        joined = "\n".join(texts).encode("utf-8", "surrogateescape")
        if self.regex.search(joined) is None:
            return texts, 0
        out: list[str] = []
        total = 0
        for t in texts:
            clean, n = self.scrub_text(t)
            out.append(clean)
            total += n
        return out, total


class StreamScrubber:
    """Feed chunks, get scrubbed chunks; `flush()` at the end returns the held-back tail."""

    def __init__(self, patterns: Patterns) -> None:
        self.patterns = patterns
        self.hold = patterns.max_len - 1
        self.buf = b""
        self.count = 0

    def feed(self, chunk: bytes) -> bytes:
        if not chunk:
            return b""
        buf, n = self.patterns.regex.subn(REDACTED, self.buf + chunk)
        self.count += n
        # any match starting before `cut` ended inside `buf` and is already replaced;
        # a form still incomplete at the end starts at or after `cut` and waits
        cut = len(buf) - self.hold
        if cut <= 0:
            self.buf = buf
            return b""
        self.buf = buf[cut:]
        return buf[:cut]

    def flush(self) -> bytes:
        buf, n = self.patterns.regex.subn(REDACTED, self.buf)
        self.count += n
        self.buf = b""
        return buf
