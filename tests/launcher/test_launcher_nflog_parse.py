"""NFLOG message parsing from captured kernel bytes, fuzzed; and a live kernel round trip."""

from __future__ import annotations

import secrets
import socket
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.launcher import nflog

# captured on this kernel: `log prefix "stockade:blocked" group N` in an output chain
UDP_CAPTURE = bytes.fromhex(
    "7400000000040000000000000000000002001d4a080001000800030015000a0073746f636b6164653a626c"
    "6f636b656400000000080005000000000108000b000000000008000e00000000002500090045000021ab64"
    "4000401191657f0000017f000001c39bbb7f000dfe2068656c6c6f000000"
)
TCP_CAPTURE = bytes.fromhex(
    "8800000000040000000000000000000002001d4a080001000800030013000a0073746f636b6164653a7370"
    "6f6f660000080005000000000108000b000000000008000e0000000000400009004500003cd94f40004006"
    "636a7f0000017f0000019e54bb7e5c82b7e400000000a002ffd7fe3000000204ffd70402080acac1e05700"
    "0000000103030a"
)


def test_parse_captured_udp() -> None:
    [r] = nflog.parse_messages(UDP_CAPTURE)
    assert r.prefix == "stockade:blocked"
    assert (r.family, r.transport, r.src, r.dst) == ("ipv4", "udp", "127.0.0.1", "127.0.0.1")
    assert (r.sport, r.dport) == (50075, 47999)
    assert r.ifindex is None  # an output-hook record has no in-interface


def test_parse_captured_tcp_and_concatenated() -> None:
    recs = nflog.parse_messages(TCP_CAPTURE + UDP_CAPTURE)
    assert [r.transport for r in recs] == ["tcp", "udp"]
    assert recs[0].prefix == "stockade:spoof" and recs[0].dport == 47998


def test_parse_l3_ipv6_and_garbage() -> None:
    v6 = bytes([0x60, 0, 0, 0, 0, 8, 17, 64]) + bytes(15) + b"\x01" + bytes(15) + b"\x02"
    v6 += (1234).to_bytes(2, "big") + (53).to_bytes(2, "big") + bytes(4)
    assert nflog.parse_l3(v6) == ("ipv6", "::1", "::2", "udp", 1234, 53)
    assert nflog.parse_l3(b"") == ("other", None, None, "other", None, None)
    assert nflog.parse_l3(b"\x45\x00")[0] == "other"


def test_truncated_message_is_ignored() -> None:
    assert nflog.parse_messages(UDP_CAPTURE[:40]) == []
    assert nflog.parse_messages(b"") == []


def test_bind_messages_shape() -> None:
    msgs = nflog.bind_messages(7413)
    assert len(msgs) == 4
    for m in msgs:
        assert int.from_bytes(m[:4], "little") == len(m)
        assert m[4:6] == ((4 << 8) | 1).to_bytes(2, "little")  # NFULNL config message
        assert m[18:20] == (7413).to_bytes(2, "big")  # group in res_id, network order


@settings(deadline=None)
@given(st.binary(max_size=600))
def test_parser_never_raises(data: bytes) -> None:
    for r in nflog.parse_messages(data):
        assert isinstance(r.prefix, str)


@settings(deadline=None)
@given(st.binary(max_size=200))
def test_parser_survives_corrupted_capture(tail: bytes) -> None:
    nflog.parse_messages(UDP_CAPTURE[:60] + tail)
    nflog.parse_l3(tail)


@pytest.mark.netns
def test_live_kernel_record() -> None:
    table = f"stockade_nl{secrets.token_hex(4)}"
    group = 7400 + secrets.randbelow(90)
    port = 40000 + secrets.randbelow(9999)
    subprocess.run(["nft", "-f", "-"], check=True, input=(
        f'table inet {table} {{\n chain out {{ type filter hook output priority 0; '
        f'policy accept;\n oifname "lo" udp dport {port} limit rate 10/second '
        f'log prefix "stockade:blocked" group {group}\n }}\n}}\n').encode())
    try:
        sock = nflog.NflogSocket(group)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.sendto(b"x", ("127.0.0.1", port))
            recs = sock.recv(2.0)
            assert [(r.prefix, r.dport, r.transport) for r in recs] == [
                ("stockade:blocked", port, "udp")]
        finally:
            sock.close()
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], check=False)
