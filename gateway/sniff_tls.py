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
_DIGITS_DOTS = re.compile(r"[0-9.]+")
_HOST_NAME_BYTES = re.compile(rb"[\x21-\x7e]+")  # printable ASCII, no space, not empty
MAX_RECORD = 2**14 + 256  # a TLSPlaintext fragment may not exceed 2^14; slack for old stacks


@dataclass(frozen=True, slots=True)
class ClientHello:
    sni: str | None  # the single host_name, ASCII as sent (not yet normalised)
    sni_is_ip: bool  # the host_name is an IP literal (RFC 6066 forbids it; we flag it)
    ech: bool  # an encrypted_client_hello extension is present
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


class _Reader:
    """Bounds-checked big-endian reader over one message; raises ValueError past the end."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes, pos: int = 0, end: int | None = None) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf) if end is None else end

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise ValueError("truncated")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def vec(self, len_bytes: int) -> _Reader:
        n = int.from_bytes(self.take(len_bytes), "big")
        start = self.pos
        self.take(n)
        return _Reader(self.buf, start, start + n)

    def done(self) -> bool:
        return self.pos == self.end


def parse_client_hello_body(msg: bytes) -> ClientHello | SniffError:
    """Parse one complete handshake message (4-byte header + body)."""
    try:
        r = _Reader(msg)
        if r.u8() != CLIENT_HELLO:
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "first handshake is not ClientHello")
        body = r.vec(3)
        if not r.done():
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "trailing bytes after ClientHello")
        version = body.u16()
        if version >> 8 != 3:
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "not a TLS version")
        body.take(32)  # random
        sid = body.vec(1)
        if sid.end - sid.pos > 32:
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "session id too long")
        suites = body.vec(2)
        if (suites.end - suites.pos) % 2 or suites.end == suites.pos:
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "bad cipher suite list")
        comp = body.vec(1)
        if comp.end == comp.pos:
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "empty compression list")
        if body.done():
            # pre-TLS1.2 hello without extensions: it cannot carry an SNI
            return ClientHello(None, False, False, (), len(msg))
        exts = body.vec(2)
        if not body.done():
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "trailing bytes after extensions")
        seen: set[int] = set()
        sni: str | None = None
        ech = False
        alpn: tuple[str, ...] = ()
        # the extension walk is the hot loop (15-20 extensions): plain offsets, no objects
        buf, pos, end = exts.buf, exts.pos, exts.end
        while pos < end:
            if pos + 4 > end:
                raise ValueError("truncated extension header")
            etype = (buf[pos] << 8) | buf[pos + 1]
            start = pos + 4
            pos = start + ((buf[pos + 2] << 8) | buf[pos + 3])
            if pos > end:
                raise ValueError("truncated extension")
            if etype in seen:
                return SniffError(Reason.PROTOCOL_UNRECOGNISED, "duplicate extension")
            seen.add(etype)
            if etype == EXT_SERVER_NAME:
                result = _parse_sni(_Reader(buf, start, pos))
                if isinstance(result, SniffError):
                    return result
                sni = result
            elif etype == EXT_ECH:
                ech = True
            elif etype == EXT_ALPN:
                alpn = _parse_alpn(_Reader(buf, start, pos))
    except ValueError:
        return SniffError(Reason.PROTOCOL_UNRECOGNISED, "malformed ClientHello")
    return ClientHello(sni, sni is not None and _looks_like_ip(sni), ech, alpn, len(msg))


def _parse_sni(r: _Reader) -> str | SniffError:
    names = r.vec(2)
    if not r.done():
        raise ValueError("trailing bytes in server_name")
    found: list[str] = []
    while not names.done():
        name_type = names.u8()
        raw = names.vec(2)
        value = raw.take(raw.end - raw.pos)
        if name_type != 0:
            continue  # unknown name types are skipped per RFC 6066; only host_name counts
        if not _HOST_NAME_BYTES.fullmatch(value):
            return SniffError(Reason.INVALID_HOST, "host_name is not printable ASCII")
        found.append(value.decode("ascii"))
    if len(found) != 1:
        return SniffError(Reason.SNI_MISSING, f"{len(found)} host_name entries (need exactly 1)")
    return found[0]


def _parse_alpn(r: _Reader) -> tuple[str, ...]:
    protos = r.vec(2)
    out: list[str] = []
    while not protos.done():
        p = protos.vec(1)
        out.append(p.take(p.end - p.pos).decode("ascii", "replace"))
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
            hdr = self._buf[self._pos : self._pos + 5]
            if hdr[0] != HANDSHAKE:
                return SniffError(Reason.PROTOCOL_UNRECOGNISED, "not a TLS handshake record")
            if hdr[1] != 3 or hdr[2] > 4:
                return SniffError(Reason.PROTOCOL_UNRECOGNISED, "bad record version")
            length = int.from_bytes(hdr[3:5], "big")
            if length == 0 or length > MAX_RECORD:
                return SniffError(Reason.PROTOCOL_UNRECOGNISED, "bad record length")
            if len(self._buf) - self._pos - 5 < length:
                break
            self._hs += self._buf[self._pos + 5 : self._pos + 5 + length]
            self._pos += 5 + length
            if len(self._hs) >= 4:
                if self._hs[0] != CLIENT_HELLO:
                    return SniffError(
                        Reason.PROTOCOL_UNRECOGNISED, "first handshake is not ClientHello"
                    )
                need = 4 + int.from_bytes(self._hs[1:4], "big")
                if need > self.max_bytes:
                    return SniffError(Reason.HEAD_TOO_LARGE, "ClientHello exceeds the sniff cap")
                if len(self._hs) >= need:
                    return parse_client_hello_body(bytes(self._hs[:need]))
        # an incomplete record header or body: check early what can be checked
        rest = self._buf[self._pos :]
        if rest and rest[0] != HANDSHAKE:
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "not a TLS handshake record")
        if len(rest) >= 2 and rest[1] != 3:
            return SniffError(Reason.PROTOCOL_UNRECOGNISED, "bad record version")
        return None


def looks_like_tls(first: bytes) -> bool:
    return len(first) >= 1 and first[0] == HANDSHAKE
