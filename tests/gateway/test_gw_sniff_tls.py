from __future__ import annotations

import pytest
from gw_tlsgen import (
    _ext,
    hello_with_sni,
    long_alpn,
    real_client_hello,
    refragment,
    sni_ext,
    synthetic_hello,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.gateway.sniff_common import NEED_MORE, SniffError
from stockade.gateway.sniff_tls import ClientHello, TlsSniffer
from stockade.policy.reasons import Reason


def sniff_all(data: bytes, max_bytes: int = 16384) -> object:
    return TlsSniffer(max_bytes).feed(data)


def sniff_split(data: bytes, cuts: list[int], max_bytes: int = 16384) -> object:
    s = TlsSniffer(max_bytes)
    pos = 0
    result: object = NEED_MORE
    for cut in [*sorted(set(cuts)), len(data)]:
        if cut <= pos:
            continue
        result = s.feed(data[pos:cut])
        pos = cut
        if result is not NEED_MORE:
            break
    return result


def test_real_client_hello_gives_sni_and_alpn() -> None:
    hello = real_client_hello("allowed.test", alpn=["h2", "http/1.1"])
    r = sniff_all(hello)
    assert isinstance(r, ClientHello)
    assert r.sni == "allowed.test"
    assert r.alpn == ("h2", "http/1.1")
    assert not r.ech and not r.sni_is_ip


def test_large_hello_split_across_records_and_segments() -> None:
    hello = real_client_hello("pypi.test", alpn=long_alpn(1600))
    assert len(hello) > 1536
    fragmented = refragment(hello, 100)  # 16+ TLS records
    assert fragmented.count(b"\x16\x03\x01") >= 16
    s = TlsSniffer()
    results = [s.feed(fragmented[i : i + 7]) for i in range(0, len(fragmented), 7)]
    assert all(r is NEED_MORE for r in results[:-1])
    final = results[-1]
    assert isinstance(final, ClientHello)
    assert final.sni == "pypi.test"
    assert final.size > 1536


def test_need_more_until_complete() -> None:
    hello = real_client_hello("allowed.test")
    s = TlsSniffer()
    assert s.feed(hello[:-1]) is NEED_MORE
    assert isinstance(s.feed(hello[-1:]), ClientHello)


def test_no_sni_is_sni_missing() -> None:
    r = sniff_all(real_client_hello(None))
    assert isinstance(r, ClientHello) and r.sni is None


def test_two_host_names_are_refused() -> None:
    r = sniff_all(hello_with_sni("allowed.test", "denied.test"))
    assert isinstance(r, SniffError) and r.reason == Reason.SNI_MISSING


def test_empty_server_name_list_is_refused() -> None:
    r = sniff_all(synthetic_hello([sni_ext([])]))
    assert isinstance(r, SniffError) and r.reason == Reason.SNI_MISSING


def test_unknown_name_type_is_skipped_but_one_host_name_needed() -> None:
    r = sniff_all(synthetic_hello([sni_ext([(7, b"x"), (0, b"allowed.test")])]))
    assert isinstance(r, ClientHello) and r.sni == "allowed.test"


@pytest.mark.parametrize("name", ["10.0.0.1", "::1", "[::1]", "169.254.169.254"])
def test_ip_literal_sni_is_flagged(name: str) -> None:
    r = sniff_all(hello_with_sni(name))
    assert isinstance(r, ClientHello) and r.sni_is_ip


def test_ech_is_flagged() -> None:
    r = sniff_all(hello_with_sni("allowed.test", ech=True))
    assert isinstance(r, ClientHello) and r.ech


@pytest.mark.parametrize("etype", [0xFFCE, 0xFF02, 0xFE08, 0xFE0A, 0xFE0C])
def test_legacy_esni_and_ech_drafts_are_flagged(etype: int) -> None:
    # a cover SNI plus the hidden name in ESNI or a draft ECH extension: a server
    # speaking that draft routes by the hidden name
    r = sniff_all(synthetic_hello([sni_ext([(0, b"allowed.test")]), _ext(etype, b"\x00" * 40)]))
    assert isinstance(r, ClientHello) and r.ech and r.sni == "allowed.test"
    other = sniff_all(synthetic_hello([sni_ext([(0, b"allowed.test")]), _ext(0xFE0E, b"")]))
    assert isinstance(other, ClientHello) and not other.ech  # an unassigned codepoint


def test_duplicate_extension_is_refused() -> None:
    ext = sni_ext([(0, b"allowed.test")])
    r = sniff_all(synthetic_hello([ext, ext]))
    assert isinstance(r, SniffError)


@pytest.mark.parametrize("bad", [b"allowed test", b"allowed\x00.test", b"\xc3\xa9.test", b""])
def test_non_ascii_host_name_is_refused(bad: bytes) -> None:
    r = sniff_all(synthetic_hello([sni_ext([(0, bad)])]))
    assert isinstance(r, SniffError) and r.reason == Reason.INVALID_HOST


def test_not_handshake_record_is_refused_on_first_byte() -> None:
    r = sniff_all(b"\x17")
    assert isinstance(r, SniffError) and r.reason == Reason.PROTOCOL_UNRECOGNISED


def test_cap_is_enforced() -> None:
    hello = real_client_hello("pypi.test", alpn=long_alpn(4000))
    r = sniff_all(hello, max_bytes=2048)
    assert isinstance(r, SniffError) and r.reason == Reason.HEAD_TOO_LARGE


def test_oversized_declared_length_refused_before_data() -> None:
    # a handshake header that announces 1 MiB: refused without waiting for it
    data = b"\x16\x03\x01\x00\x04" + b"\x01\x10\x00\x00"
    r = sniff_all(data)
    assert isinstance(r, SniffError) and r.reason == Reason.HEAD_TOO_LARGE


def test_after_result_feed_is_stable() -> None:
    s = TlsSniffer()
    first = s.feed(real_client_hello("allowed.test"))
    assert s.feed(b"more bytes") == first


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    r = sniff_all(data)
    assert r is NEED_MORE or isinstance(r, SniffError | ClientHello)
    if isinstance(r, ClientHello) and r.sni is not None:
        assert r.sni.isascii() and r.sni.isprintable() and " " not in r.sni


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600).map(lambda b: b"\x16\x03\x01" + b))
def test_arbitrary_handshake_records_never_crash(data: bytes) -> None:
    r = sniff_all(data)
    assert r is NEED_MORE or isinstance(r, SniffError | ClientHello)


_HELLO = real_client_hello("allowed.test", alpn=long_alpn(1600))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(_HELLO) - 1), max_size=40))
def test_split_points_do_not_change_the_result(cuts: list[int]) -> None:
    assert sniff_split(_HELLO, cuts) == sniff_all(_HELLO)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=len(_HELLO) - 1), st.integers(0, 255))
def test_mutated_hello_never_crashes(pos: int, value: int) -> None:
    data = bytearray(_HELLO)
    data[pos] = value
    r = sniff_all(bytes(data))
    assert r is NEED_MORE or isinstance(r, SniffError | ClientHello)
    if isinstance(r, ClientHello) and r.sni is not None:
        assert r.sni.isascii() and r.sni.isprintable()


_HELLO_BODY = real_client_hello("allowed.test", alpn=["h2", "http/1.1"])[5:]


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(_HELLO_BODY) - 1), st.integers(0, 255)), max_size=4),
    st.integers(0, len(_HELLO_BODY)),
)
def test_offset_parser_agrees_with_the_reader_oracle(
    changes: list[tuple[int, int]], keep: int
) -> None:
    from stockade.gateway.sniff_tls import parse_client_hello_body
    from tls_oracle import parse_client_hello_body as oracle

    data = bytearray(_HELLO_BODY)
    for pos, value in changes:
        data[pos] = value
    msg = bytes(data[:keep])
    assert parse_client_hello_body(msg) == oracle(msg)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0x0000, 0x0010, 0xFE0D, 0xFFCE, 0xFE0A, 0x002B, 0x000A]),
            st.binary(max_size=40),
        ),
        max_size=6,
    ),
    st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=20)), max_size=3),
)
def test_offset_parser_agrees_on_synthetic_extensions(
    exts: list[tuple[int, bytes]], names: list[tuple[int, bytes]]
) -> None:
    from stockade.gateway.sniff_tls import parse_client_hello_body
    from tls_oracle import parse_client_hello_body as oracle

    built = [_ext(t, d) for t, d in exts] + ([sni_ext(names)] if names else [])
    msg = synthetic_hello(built)[5:]
    assert parse_client_hello_body(msg) == oracle(msg)
