"""Injection, token buckets/budgets and the body decoder (pure parts)."""

from __future__ import annotations

import base64
import gzip
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.broker.decode import (
    BodyDecoder,
    DecodeLimit,
    EncodingRefused,
    check_transfer_coding,
)
from stockade.broker.inject import inject, strip_injected_query
from stockade.broker.limits import Budget, Limiter, TokenBucket
from stockade.broker.request import RequestError
from stockade.policy.model import Injection


def test_bearer() -> None:
    got = inject(Injection("bearer"), "s3cr3t")
    assert got.headers == (("Authorization", "Bearer s3cr3t"),) and got.query == ()


def test_header_template_uses_no_format() -> None:
    got = inject(Injection("header", header="X-Api-Key", template="Token {secret} {0.__class__}"),
                 "abc")
    assert got.headers == (("X-Api-Key", "Token abc {0.__class__}"),)


def test_basic_and_query() -> None:
    b = inject(Injection("basic", username="x"), "pw")
    token = base64.b64encode(b"x:pw").decode()
    assert b.headers == (("Authorization", f"Basic {token}"),)
    assert token in b.rendered_values
    q = inject(Injection("query", query_param="key"), "pw")
    assert q.query == (("key", "pw"),)
    inj = Injection("query", query_param="key")
    assert strip_injected_query(("key=mine", "a=1", "k%65y=x", "key"), inj) == ("a=1",)


def test_secret_with_crlf_refused() -> None:
    with pytest.raises(RequestError):
        inject(Injection("bearer"), "a\r\nX-Evil: 1")
    with pytest.raises(RequestError):
        inject(Injection("bearer"), "")


def test_token_bucket() -> None:
    b = TokenBucket(rate=2.0, burst=3)
    assert [b.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = b.take(100.0)
    assert wait == pytest.approx(0.5)
    assert b.take(100.5) == 0.0
    assert b.take(100.5) > 0


def test_budget_and_limiter_forget() -> None:
    lim = Limiter()
    bud = lim.budget("t1", "gh", 2, 100)
    assert not bud.exhausted()
    bud.charge_call()
    bud.charge_call()
    assert bud.exhausted()
    assert lim.budget("t1", "gh", 3, 100).used_calls == 2  # reload keeps usage
    b2 = Budget(None, 10)
    b2.charge_bytes(10)
    assert b2.exhausted() and b2.bytes_left() == 0
    lim.bucket("t1", "gh", 1, 1)
    lim.forget("t1")
    assert lim.budgets == {} and lim.buckets == {}


@pytest.mark.parametrize(
    ("coding", "blob"),
    [("gzip", gzip.compress(b"hello " * 1000)), ("deflate", zlib.compress(b"hello " * 1000)),
     ("deflate", zlib.compress(b"hello " * 1000)[2:-4]), ("identity", b"hello " * 1000),
     (None, b"hello " * 1000)],
)
def test_decoder(coding: str | None, blob: bytes) -> None:
    d = BodyDecoder(coding, 10**6)
    out = b"".join(d.feed(blob[i:i + 7]) for i in range(0, len(blob), 7)) + d.flush()
    assert out == b"hello " * 1000


def test_decoder_refuses_and_caps() -> None:
    for bad in ("br", "zstd", "gzip, br", "compress"):
        with pytest.raises(EncodingRefused):
            BodyDecoder(bad, 100)
    d = BodyDecoder("gzip", 1000)
    with pytest.raises(DecodeLimit):
        d.feed(gzip.compress(b"\0" * 10**6))
    d = BodyDecoder("gzip", 1000)
    with pytest.raises(EncodingRefused):
        d.feed(b"not gzip at all")


@pytest.mark.parametrize("te", [None, "", "chunked", "Chunked", "identity, chunked"])
def test_transfer_coding_chunked_only_passes(te: str | None) -> None:
    check_transfer_coding(te)


@pytest.mark.parametrize("te", ["gzip, chunked", "chunked, gzip", "deflate", "x-gzip",
                                "compress,chunked", "GZIP , chunked", "br"])
def test_transfer_coding_that_would_hide_the_key_refused(te: str) -> None:
    with pytest.raises(EncodingRefused):
        check_transfer_coding(te)


@settings(max_examples=300, deadline=None)
@given(
    rate=st.floats(min_value=0.1, max_value=100),
    burst=st.integers(min_value=1, max_value=50),
    gaps=st.lists(st.floats(min_value=0, max_value=2), min_size=1, max_size=200),
)
def test_property_bucket_never_exceeds_burst_plus_rate(
    rate: float, burst: int, gaps: list[float]
) -> None:
    b = TokenBucket(rate=rate, burst=burst)
    now, granted = 0.0, 0
    for g in gaps:
        now += g
        if b.take(now) == 0.0:
            granted += 1
        else:
            assert b.take(now) > 0  # a refusal says how long to wait
    assert granted <= burst + rate * now + 1e-6
