"""The HelloRetryRequest watcher (gateway/tls_retry.py), without sockets: the server's
first handshake message split anywhere and fragmented over records, then the client's
second ClientHello (after at most one compatibility CCS) held to the first's SNI."""

from __future__ import annotations

import contextlib
import itertools
import os
import ssl
import struct

import pytest
import trustme
from gw_tlsgen import _ext, hello_with_sni, real_client_hello, refragment, sni_ext, synthetic_hello
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.gateway.sniff_common import NEED_MORE
from stockade.gateway.sniff_tls import TlsSniffer
from stockade.gateway.tls_retry import (
    CCS_RECORD,
    HRR_RANDOM,
    Refused,
    RetryWatch,
    Step,
    first_hello_end,
)
from stockade.policy import normalize_host
from stockade.policy.reasons import Reason

HOST = "allowed.test"
CAP = 16384


def server_hello(random: bytes = HRR_RANDOM, record_version: bytes = b"\x03\x03") -> bytes:
    """A ServerHello record (a HelloRetryRequest with the default `random`)."""
    body = b"\x03\x03" + random + b"\x20" + os.urandom(32) + b"\x13\x01\x00"
    body += struct.pack(">H", 6) + b"\x00\x2b\x00\x02\x03\x04"  # supported_versions
    hs = b"\x02" + len(body).to_bytes(3, "big") + body
    return b"\x16" + record_version + struct.pack(">H", len(hs)) + hs


HRR = server_hello()
SERVER_HELLO = server_hello(os.urandom(32))
ALERT = b"\x15\x03\x03\x00\x02\x02\x28"


def retried(host: str = HOST) -> RetryWatch:
    w = RetryWatch(host, CAP)
    assert w.server(HRR) is Step.RETRY
    return w


def feed_client(w: RetryWatch, chunks: list[bytes]) -> object:
    r: object = NEED_MORE
    for c in chunks:
        r = w.client(c)
        if r is not NEED_MORE:
            break
    return r


def feed_server(w: RetryWatch, chunks: list[bytes]) -> object:
    r: object = Step.NEED_MORE
    for c in chunks:
        r = w.server(c)
        if r is not Step.NEED_MORE:
            break
    return r


# -- the server's first message -------------------------------------------------------------
def test_real_openssl_retry_and_second_hello() -> None:
    """OpenSSL's own HRR (the server supports only P-384; the client's key share is
    X25519) and the client's answer (CCS, then the second hello)."""
    ca = trustme.CA()
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert(HOST).configure_cert(sctx)
    sctx.set_ecdh_curve("secp384r1")
    cctx = ssl.create_default_context()
    ca.configure_trust(cctx)
    cin, cout, sin, sout = (ssl.MemoryBIO() for _ in range(4))
    client = cctx.wrap_bio(cin, cout, server_hostname=HOST)
    server = sctx.wrap_bio(sin, sout, server_side=True)
    for side in (client, server):
        with contextlib.suppress(ssl.SSLWantReadError):
            if side is server:
                sin.write(cout.read())
            side.do_handshake()
    hrr = sout.read()
    w = RetryWatch(HOST, CAP)
    assert w.server(hrr) is Step.RETRY
    cin.write(hrr)
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    second = cout.read()
    assert second.startswith(CCS_RECORD)
    assert w.client(second) is Step.OK


@pytest.mark.parametrize("answer", [HRR, SERVER_HELLO])
def test_server_split_at_every_offset(answer: bytes) -> None:
    want = Step.RETRY if answer is HRR else Step.NO_RETRY
    for i in range(len(answer) + 1):
        for j in range(i, min(len(answer), i + 45) + 1):
            w = RetryWatch(HOST, CAP)
            assert feed_server(w, [answer[:i], answer[i:j], answer[j:]]) is want, (i, j)


@pytest.mark.parametrize("size", [1, 2, 5, 37, 38])
def test_server_hello_fragmented_over_records(size: int) -> None:
    for answer, want in ((HRR, Step.RETRY), (SERVER_HELLO, Step.NO_RETRY)):
        frags = refragment(answer, size)
        w = RetryWatch(HOST, CAP)
        assert feed_server(w, [frags[k : k + 1] for k in range(len(frags))]) is want
        assert RetryWatch(HOST, CAP).server(frags) is want


def test_no_handshake_first_passes_through() -> None:
    for first in (ALERT, b"\x15", b"HTTP/1.1 400 Bad Request\r\n\r\n", b"\x17\x03\x03\x00\x01x"):
        w = RetryWatch(HOST, CAP)
        assert w.server(first) is Step.NO_RETRY
        assert w.server(HRR) is Step.NO_RETRY  # decided: no longer watched


def test_other_handshake_first_passes_through() -> None:
    hello_request = b"\x16\x03\x03\x00\x04\x00\x00\x00\x00"
    assert RetryWatch(HOST, CAP).server(hello_request) is Step.NO_RETRY


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        (b"\x16\x02\x00\x00\x05", "bad record version from the server"),
        (b"\x16\x03\x03\x00\x00", "bad record length from the server"),
        (b"\x16\x03\x03\x48\x01", "bad record length from the server"),
        (b"\x16\x03\x03\x00\x04\x02\x00\x00\x10", "truncated ServerHello"),
        (refragment(HRR, 10)[:15] + ALERT, "another record inside the server's first"),
    ],
)
def test_malformed_server_answers_are_refused(answer: bytes, detail: str) -> None:
    r = RetryWatch(HOST, CAP).server(answer)
    assert isinstance(r, Refused) and r.reason == Reason.PROTOCOL_UNRECOGNISED
    assert r.detail.startswith(detail)


def test_client_bytes_before_a_retry_are_a_bug() -> None:
    with pytest.raises(RuntimeError):
        RetryWatch(HOST, CAP).client(hello_with_sni(HOST))


# -- the second ClientHello ------------------------------------------------------------------
@pytest.mark.parametrize("sni", [HOST, "ALLOWED.test", "allowed.test."])
def test_same_host_passes_normalised(sni: str) -> None:
    assert retried().client(CCS_RECORD + hello_with_sni(sni)) is Step.OK
    assert retried().client(hello_with_sni(sni)) is Step.OK


def test_idn_is_compared_in_a_labels() -> None:
    host = normalize_host("bücher.test")
    assert retried(host).client(hello_with_sni("XN--BCHER-KVA.TEST.")) is Step.OK


def test_second_hello_split_at_every_offset() -> None:
    data = CCS_RECORD + real_client_hello(HOST)
    for i in range(len(data) + 1):
        assert feed_client(retried(), [data[:i], data[i:]]) is Step.OK, i
    assert feed_client(retried(), [data[k : k + 1] for k in range(len(data))]) is Step.OK
    refrag = CCS_RECORD + refragment(real_client_hello(HOST), 7)
    assert retried().client(refrag) is Step.OK


def _mismatch(data: bytes, detail: str) -> None:
    r = feed_client(retried(), [data])
    assert isinstance(r, Refused), r
    assert r.reason == Reason.DESTINATION_MISMATCH
    assert detail in r.detail


def test_another_host_is_a_mismatch() -> None:
    _mismatch(CCS_RECORD + hello_with_sni("other.test"), "names other.test, the first allowed")
    _mismatch(hello_with_sni("sub.allowed.test"), "names sub.allowed.test")


def test_ech_ip_and_missing_names_are_mismatches() -> None:
    _mismatch(hello_with_sni(HOST, ech=True), "encrypted name")
    _mismatch(synthetic_hello([sni_ext([(0, b"allowed.test")]), _ext(0xFFCE, b"x")]),
              "encrypted name")  # fmt: skip
    _mismatch(hello_with_sni("192.0.2.1"), "IP literal")
    _mismatch(hello_with_sni(), "names no host")
    _mismatch(hello_with_sni(HOST, "other.test"), "2 host_name entries")
    _mismatch(synthetic_hello([sni_ext([(0, b"bad host")])]), "printable ASCII")
    _mismatch(hello_with_sni("a..test"), "invalid host")


@pytest.mark.parametrize(
    "data",
    [
        CCS_RECORD + CCS_RECORD + hello_with_sni(HOST),  # a second CCS
        b"\x17\x03\x03\x00\x05hello",  # application data
        ALERT,
        b"\x14\x03\x03\x00\x01\x02" + hello_with_sni(HOST),  # not the compatibility CCS
        b"\x14\x03\x01\x00\x01\x01" + hello_with_sni(HOST),
        b"\x14\x03\x03\x00\x02\x01\x01" + hello_with_sni(HOST),
        b"GET / HTTP/1.1\r\n\r\n",
        b"\x16\x03\x03\x00\x04\x02\x00\x00\x00",  # a handshake that is no ClientHello
    ],
)
def test_anything_else_in_place_of_the_hello_is_refused(data: bytes) -> None:
    r = feed_client(retried(), [data[:3], data[3:]])
    assert isinstance(r, Refused) and r.reason == Reason.PROTOCOL_UNRECOGNISED


def test_a_second_hello_over_the_cap_is_refused() -> None:
    w = RetryWatch(HOST, 1024)
    assert w.server(HRR) is Step.RETRY
    big = synthetic_hello([sni_ext([(0, HOST.encode())]), _ext(0x0015, b"\x00" * 2000)])
    r = w.client(big)
    assert isinstance(r, Refused) and r.reason == Reason.HEAD_TOO_LARGE


def test_the_verdict_is_final() -> None:
    w = retried()
    assert w.client(hello_with_sni("other.test")) == w.client(hello_with_sni(HOST))
    ok = retried()
    assert ok.client(hello_with_sni(HOST)) is Step.OK
    assert ok.client(b"anything after") is Step.OK


# -- where the first hello ends --------------------------------------------------------------
def test_first_hello_end() -> None:
    hello = real_client_hello(HOST, alpn=["h2"])
    size = len(hello) - 5
    assert first_hello_end(hello, size) == len(hello)
    assert first_hello_end(hello + CCS_RECORD + b"x", size) == len(hello)
    frag = refragment(hello, 100)
    assert first_hello_end(frag + hello_with_sni("other.test"), size) == len(frag)
    # the hello and more handshake bytes in one record: cannot be held apart
    hs = frag_hs = hello[5:] + hello_with_sni("other.test")[5:]
    glued = b"\x16\x03\x01" + struct.pack(">H", len(frag_hs)) + hs
    r = first_hello_end(glued, size)
    assert isinstance(r, Refused) and r.reason == Reason.PROTOCOL_UNRECOGNISED


# -- properties -------------------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200), st.lists(st.integers(0, 200), max_size=6))
def test_random_server_bytes_never_crash(data: bytes, cuts: list[int]) -> None:
    w = RetryWatch(HOST, CAP)
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    r = feed_server(w, [data[a:b] for a, b in itertools.pairwise(bounds)])
    assert r is Step.NEED_MORE or r in (Step.NO_RETRY, Step.RETRY) or isinstance(r, Refused)
    if r is Step.RETRY:
        assert HRR_RANDOM in data


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 300))
def test_random_client_bytes_never_pass(data: bytes, cut: int) -> None:
    r = feed_client(retried(), [data[:cut], data[cut:]])
    assert r is NEED_MORE or isinstance(r, Refused)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["other.test", "allowed.test.evil", "xallowed.test", "ALLOWED.TEST.x"]),
    st.booleans(),
    st.integers(1, 64),
    st.data(),
)
def test_a_mismatching_hello_never_passes_however_cut(
    sni: str, ccs: bool, record: int, data: st.DataObject
) -> None:
    hello = (CCS_RECORD if ccs else b"") + refragment(hello_with_sni(sni), record)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(hello)), max_size=5)))
    bounds = [0, *cuts, len(hello)]
    r = feed_client(retried(), [hello[a:b] for a, b in itertools.pairwise(bounds)])
    assert isinstance(r, Refused) and r.reason == Reason.DESTINATION_MISMATCH


def test_sniffer_is_the_one_used() -> None:
    """The second hello is parsed by the first's parser (same cap, same strictness)."""
    w = retried()
    w.client(CCS_RECORD)
    assert isinstance(w._sniffer, TlsSniffer) and w._sniffer.max_bytes == CAP
