"""The reader-object ClientHello parser the gateway used until the offset rewrite, kept
verbatim as an oracle: the fast parser must give the same result for every input."""

from __future__ import annotations

from stockade.gateway.sniff_common import SniffError
from stockade.gateway.sniff_tls import (
    _HOST_NAME_BYTES,
    CLIENT_HELLO,
    ENCRYPTED_NAME_EXTS,
    EXT_ALPN,
    EXT_SERVER_NAME,
    ClientHello,
    _looks_like_ip,
)
from stockade.policy.reasons import Reason


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
            elif etype in ENCRYPTED_NAME_EXTS:
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


