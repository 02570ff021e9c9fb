"""The scrubber: every encoded form of the secret, split at any chunk boundary, is removed."""

from __future__ import annotations

import base64
import json
from urllib.parse import quote, quote_plus

from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.broker.scrub import REDACTED, Patterns, StreamScrubber, forms

SECRET = "sk-test-4f9a2b7c1d8e3f60/+=ä"


def encodings(secret: str) -> list[bytes]:
    raw = secret.encode()
    out = [raw, raw.hex().encode(), raw.hex().upper().encode(),
           quote(secret, safe="").encode(), quote_plus(secret).encode(),
           json.dumps(secret)[1:-1].encode(), json.dumps(secret, ensure_ascii=False)[1:-1].encode(),
           json.dumps(secret).replace("/", "\\/")[1:-1].encode()]
    for prefix in (b"", b"a", b"ab", b"Bearer "):
        out.append(base64.b64encode(prefix + raw + b"xyz"))
        out.append(base64.urlsafe_b64encode(prefix + raw))
    return out


def stream(p: Patterns, data: bytes, cuts: list[int]) -> tuple[bytes, int]:
    s = StreamScrubber(p)
    out = []
    prev = 0
    for c in sorted(set(cuts)):
        out.append(s.feed(data[prev:c]))
        prev = c
    out.append(s.feed(data[prev:]))
    out.append(s.flush())
    return b"".join(out), s.count


def wrapped(text: bytes, width: int, brk: bytes) -> bytes:
    """`text` with `brk` after every `width` characters, as MIME and PEM wrap base64."""
    return brk.join(text[i:i + width] for i in range(0, len(text), width))


def unwrapped(data: bytes) -> bytes:
    return data.replace(b"\r", b"").replace(b"\n", b"").replace(b"\\r", b"").replace(
        b"\\n", b"")


def leaked(secret: str, data: bytes) -> bool:
    data = unwrapped(data)  # a base64 core is still a leak with line breaks inside
    raw = secret.encode()
    if raw in data or raw.hex().encode() in data or raw.hex().upper().encode() in data:
        return True
    if quote(secret, safe="").encode() in data:
        return True
    # a base64 core of the secret at any alignment
    return any(core in data for core in forms(secret) if len(core) >= 8)


def test_every_form_is_found_in_a_longer_text() -> None:
    p = Patterns.build([SECRET])
    for enc in encodings(SECRET):
        body = b'{"echo": "' + enc + b'", "n": 1}'
        clean, n = p.scrub(body)
        assert n >= 1, enc
        assert REDACTED in clean
        assert not leaked(SECRET, clean), enc


def test_base64_inside_basic_auth_header_is_found() -> None:
    token = base64.b64encode(f"user:{SECRET}".encode()).decode()
    p = Patterns.build([SECRET, f"Basic {token}", token])
    clean, n = p.scrub_text(f"Authorization: Basic {token}")
    assert n >= 1
    assert token not in clean and SECRET not in clean


BREAKS = (b"\n", b"\r\n", b"\\n", b"\\r\\n")


def test_wrapped_base64_is_found_at_every_break_position() -> None:
    """A line break (raw or JSON-escaped) anywhere inside the base64 of the secret: the
    lines of a MIME or PEM body, wrapped at any offset from the secret's start."""
    p = Patterns.build([SECRET])
    body = base64.b64encode(b"lead " + SECRET.encode() + b" tail")
    for brk in BREAKS:
        for width in (64, 76):
            for shift in range(width):
                data = wrapped(b"A" * shift + body, width, brk)
                clean, n = p.scrub(data)
                assert n >= 1 and not leaked(SECRET, clean), (brk, width, shift)


def test_wrapped_base64_split_across_chunks_is_found() -> None:
    p = Patterns.build([SECRET])
    data = wrapped(base64.encodebytes(b"x" * 70 + SECRET.encode() + b"y" * 50), 76,
                   b"\r\n")
    for cut in range(len(data) + 1):
        out, n = stream(p, data, [cut])
        assert n >= 1 and not leaked(SECRET, out), cut


def test_utf16_forms_are_found() -> None:
    p = Patterns.build([SECRET])
    for codec in ("utf-16-le", "utf-16-be", "utf-16"):
        clean, n = p.scrub(f"token={SECRET};".encode(codec))
        assert n == 1, codec
        assert SECRET.encode("utf-16-le") not in clean
        assert SECRET.encode("utf-16-be") not in clean


def test_ordinary_text_is_untouched() -> None:
    p = Patterns.build([SECRET])
    text = b"hello world, nothing to see here " * 100
    clean, n = p.scrub(text)
    assert (clean, n) == (text, 0)
    other = wrapped(base64.b64encode(b"an unrelated key, 0123456789 " * 8), 76, b"\n")
    assert p.scrub(other) == (other, 0)


def test_stream_split_at_every_boundary() -> None:
    p = Patterns.build([SECRET])
    for enc in encodings(SECRET):
        data = b"x" * 37 + enc + b"y" * 11 + enc
        for cut in range(len(data) + 1):
            out, n = stream(p, data, [cut])
            assert n >= 2, (enc, cut)
            assert not leaked(SECRET, out), (enc, cut)


def test_stream_without_secret_is_identity() -> None:
    p = Patterns.build([SECRET])
    data = bytes(range(256)) * 10
    out, n = stream(p, data, list(range(0, len(data), 7)))
    assert out == data and n == 0


@settings(max_examples=300, deadline=None)
@given(
    secret=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]),
                   min_size=8, max_size=40),
    prefix=st.binary(max_size=64),
    suffix=st.binary(max_size=64),
    form=st.integers(min_value=0, max_value=15),
    wrap=st.sampled_from([0, 64, 76]),
    brk=st.sampled_from(BREAKS),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=8),
)
def test_property_secret_never_emitted(
    secret: str, prefix: bytes, suffix: bytes, form: int, wrap: int, brk: bytes,
    cuts: list[int]
) -> None:
    p = Patterns.build([secret])
    encs = encodings(secret)
    enc = encs[form % len(encs)]
    if wrap and form % len(encs) >= 8:  # the base64 forms, wrapped at any offset
        enc = wrapped(prefix[:wrap] + enc, wrap, brk)
    data = prefix + enc + suffix
    out, n = stream(p, data, [c % (len(data) + 1) for c in cuts])
    assert n >= 1
    assert secret.encode() not in out
    assert secret.encode().hex().encode() not in out
    assert not leaked(secret, out)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_property_stream_equals_one_shot(data: bytes, cuts: list[int]) -> None:
    p = Patterns.build([SECRET])
    data = data + SECRET.encode() + data
    one, n1 = p.scrub(data)
    out, n2 = stream(p, data, [c % (len(data) + 1) for c in cuts])
    assert not leaked(SECRET, out)
    assert n2 >= 1 and n1 >= 1
    assert out == one
