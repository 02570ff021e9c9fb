"""Incremental, pure parser of a TLS ClientHello: SNI, ECH, ALPN.

Hand-written on purpose: this is the product's core decision input, it must be
sans-IO (bytes in, facts out), incremental across TCP segments and TLS records, and
strict where general-purpose TLS libraries are lenient (exactly one host_name, no
duplicate extensions, a size cap instead of "stop at 1 KiB"). No library exposes a
ClientHello parser with these properties without also wanting to terminate TLS.

Usage: `s = TlsSniffer(max_bytes); r = s.feed(chunk)` until `r` is not `NEED_MORE`;
the result is a `ClientHello` or a `SniffError`. Bytes are never consumed: the shell
keeps what it read and replays it upstream unchanged.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from stockade.policy.reasons import Reason

from .sniff_common import NEED_MORE, NeedMore, SniffError

HANDSHAKE = 0x16
CLIENT_HELLO = 0x01
EXT_SERVER_NAME = 0x0000
EXT_ALPN = 0x0010
EXT_ECH = 0xFE0D  # encrypted_client_hello (draft-ietf-tls-esni)
# every codepoint that has carried an encrypted server name: ECH as deployed, its earlier
# drafts (-07: 0xff02, -08..-12: 0xfe08..0xfe0c) and ESNI (0xffce); a server still
# speaking one would route by the hidden name, not by the SNI the gateway decided on
ENCRYPTED_NAME_EXTS = frozenset({EXT_ECH, 0xFF02, 0xFFCE, *range(0xFE08, 0xFE0D)})
_DIGITS_DOTS = re.compile(r"[0-9.]+")
_HOST_NAME_BYTES = re.compile(rb"[\x21-\x7e]+")  # printable ASCII, no space, not empty
MAX_RECORD = 2**14 + 256  # a TLSPlaintext fragment may not exceed 2^14; slack for old stacks


@dataclass(frozen=True, slots=True)
class ClientHello:
    sni: str | None  # the single host_name, ASCII as sent (not yet normalised)
    sni_is_ip: bool  # the host_name is an IP literal (RFC 6066 forbids it; we flag it)
    ech: bool  # an encrypted_client_hello (or legacy ESNI / ECH draft) extension is present
    alpn: tuple[str, ...]
    size: int  # bytes of the handshake message (header included)


def _looks_like_ip(name: str) -> bool:
    if ":" not in name and not _DIGITS_DOTS.fullmatch(name):
        return False  # the common case, without paying for ipaddress's exceptions
    candidate = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return True


def parse_client_hello_body(msg: bytes) -> ClientHello | SniffError:
    """Parse one complete handshake message (4-byte header + body).

    Plain offsets and explicit bounds checks (no reader objects): this runs on every TLS
    connection's set-up path. Every length is checked against its enclosing vector
    before use; running past one is "malformed"."""
    try:
        return _parse_hello(msg)
    except ValueError:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "malformed ClientHello")


def _vector(buf: bytes, pos: int, end: int, len_bytes: int) -> tuple[int, int]:
    """(start, end) of the vector whose `len_bytes` length prefix is at `pos`."""
    start = pos + len_bytes
    if start > end:
        raise ValueError("truncated length")
    stop = start + int.from_bytes(buf[pos:start], "big")
    if stop > end:
        raise ValueError("truncated vector")
    return start, stop


def _parse_hello(msg: bytes) -> ClientHello | SniffError:
    size = len(msg)
    pos = _skip_to_extensions(msg, size)
    if isinstance(pos, SniffError):
        return pos
    if pos == size:
        # pre-TLS1.2 hello without extensions: it cannot carry an SNI
        return ClientHello(None, False, False, (), size)
    pos, ext_end = _vector(msg, pos, size, 2)
    if ext_end != size:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "trailing bytes after extensions")
    return _parse_extensions(msg, pos, ext_end)


def _skip_to_extensions(msg: bytes, size: int) -> int | SniffError:
    """Check the fixed part of the hello (header, version, random, session id, cipher
    suites, compression methods); the offset just after it, or the refusal."""
    if size < 1:
        raise ValueError("empty")
    if msg[0] != CLIENT_HELLO:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "first handshake is not ClientHello")
    pos, end = _vector(msg, 1, size, 3)
    if end != size:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "trailing bytes after ClientHello")
    if pos + 2 > end:
        raise ValueError("truncated version")
    if msg[pos] != 3:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "not a TLS version")
    pos += 2 + 32  # legacy_version, random
    if pos > end:
        raise ValueError("truncated random")
    start, pos = _vector(msg, pos, end, 1)  # legacy_session_id
    if pos - start > 32:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "session id too long")
    start, pos = _vector(msg, pos, end, 2)  # cipher_suites
    if (pos - start) % 2 or pos == start:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "bad cipher suite list")
    start, pos = _vector(msg, pos, end, 1)  # legacy_compression_methods
    if pos == start:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "empty compression list")
    return pos


def _parse_extensions(msg: bytes, pos: int, ext_end: int) -> ClientHello | SniffError:
    """Walk the extensions block `msg[pos:ext_end]`, which runs to the end of `msg`."""
    seen: set[int] = set()
    sni: str | None = None
    ech = False
    alpn: tuple[str, ...] = ()
    while pos < ext_end:
        if pos + 4 > ext_end:
            raise ValueError("truncated extension header")
        etype = (msg[pos] << 8) | msg[pos + 1]
        start = pos + 4
        pos = start + ((msg[pos + 2] << 8) | msg[pos + 3])
        if pos > ext_end:
            raise ValueError("truncated extension")
        if etype in seen:
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "duplicate extension")
        seen.add(etype)
        if etype == EXT_SERVER_NAME:
            result = _parse_sni(msg, start, pos)
            if isinstance(result, SniffError):
                return result
            sni = result
        elif etype in ENCRYPTED_NAME_EXTS:
            ech = True
        elif etype == EXT_ALPN:
            alpn = _parse_alpn(msg, start, pos)
    return ClientHello(sni, sni is not None and _looks_like_ip(sni), ech, alpn, len(msg))


def _parse_sni(buf: bytes, pos: int, end: int) -> str | SniffError:
    pos, names_end = _vector(buf, pos, end, 2)
    if names_end != end:
        raise ValueError("trailing bytes in server_name")
    found: list[str] = []
    while pos < names_end:
        name_type = buf[pos]
        start, pos = _vector(buf, pos + 1, names_end, 2)
        if name_type != 0:
            continue  # unknown name types are skipped per RFC 6066; only host_name counts
        value = buf[start:pos]
        if not _HOST_NAME_BYTES.fullmatch(value):
            return SniffError(Reason.INVALID_HOST, "host_name is not printable ASCII")
        found.append(value.decode("ascii"))
    if len(found) != 1:
        return SniffError(Reason.SNI_MISSING, f"{len(found)} host_name entries (need exactly 1)")
    return found[0]


def _parse_alpn(buf: bytes, pos: int, end: int) -> tuple[str, ...]:
    pos, protos_end = _vector(buf, pos, end, 2)
    out: list[str] = []
    while pos < protos_end:
        start, pos = _vector(buf, pos, protos_end, 1)
        out.append(buf[start:pos].decode("ascii", "replace"))
    return tuple(out)


class TlsSniffer:
    """Reassembles handshake records until one full ClientHello (or an error) is known."""

    def __init__(self, max_bytes: int = 16384) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()  # raw bytes fed so far (not yet parsed into records)
        self._pos = 0  # start of the next unparsed record in _buf
        self._hs = bytearray()  # reassembled handshake bytes
        self._result: ClientHello | SniffError | None = None

    def feed(self, data: bytes) -> NeedMore | ClientHello | SniffError:
        if self._result is not None:
            return self._result
        self._buf += data
        self._result = self._advance()
        return NEED_MORE if self._result is None else self._result

    def _advance(self) -> ClientHello | SniffError | None:
        # raw bytes include record headers; tiny records could inflate them, so allow 2x
        if len(self._buf) > 2 * self.max_bytes + 64:
            return SniffError(Reason.HEAD_TOO_LARGE, "ClientHello exceeds the sniff cap")
        while len(self._buf) - self._pos >= 5:
            length = _record_length(self._buf[self._pos : self._pos + 5])
            if isinstance(length, SniffError):
                return length
            if len(self._buf) - self._pos - 5 < length:
                break
            self._hs += self._buf[self._pos + 5 : self._pos + 5 + length]
            self._pos += 5 + length
            result = self._hello()
            if result is not None:
                return result
        # an incomplete record header or body: check early what can be checked
        return _partial_header_error(self._buf[self._pos :])

    def _hello(self) -> ClientHello | SniffError | None:
        """The parsed ClientHello once the reassembled handshake bytes hold all of it."""
        if len(self._hs) < 4:
            return None
        if self._hs[0] != CLIENT_HELLO:
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "first handshake is not ClientHello")
        need = 4 + int.from_bytes(self._hs[1:4], "big")
        if need > self.max_bytes:
            return SniffError(Reason.HEAD_TOO_LARGE, "ClientHello exceeds the sniff cap")
        if len(self._hs) >= need:
            return parse_client_hello_body(bytes(self._hs[:need]))
        return None


def _record_length(hdr: bytes | bytearray) -> int | SniffError:
    """The fragment length of a complete 5-byte handshake record header, or the refusal."""
    if hdr[0] != HANDSHAKE:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "not a TLS handshake record")
    if hdr[1] != 3 or hdr[2] > 4:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "bad record version")
    length = int.from_bytes(hdr[3:5], "big")
    if length == 0 or length > MAX_RECORD:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "bad record length")
    return length


def _partial_header_error(rest: bytes | bytearray) -> SniffError | None:
    """What a record header shorter than 5 bytes already gets wrong, if anything."""
    if rest and rest[0] != HANDSHAKE:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "not a TLS handshake record")
    if len(rest) >= 2 and rest[1] != 3:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "bad record version")
    return None


def looks_like_tls(first: bytes) -> bool:
    return len(first) >= 1 and first[0] == HANDSHAKE
