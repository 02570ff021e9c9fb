"""ClientHello generators for the gateway tests: real ones from Python's ssl module
(memory BIO, nothing on the network) and synthetic ones for what ssl will not send."""

from __future__ import annotations

import contextlib
import os
import ssl
import struct


def real_client_hello(server_hostname: str | None, alpn: list[str] | None = None) -> bytes:
    """The bytes Python's ssl (OpenSSL) sends first, i.e. its ClientHello records."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if alpn:
        ctx.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def long_alpn(total: int = 1600) -> list[str]:
    """An ALPN list long enough to push a ClientHello past `total` bytes."""
    return [f"proto-{i:04d}-{'x' * 20}" for i in range(total // 30 + 1)]


def handshake_of(records: bytes) -> bytes:
    out = bytearray()
    pos = 0
    while pos < len(records):
        length = int.from_bytes(records[pos + 3 : pos + 5], "big")
        out += records[pos + 5 : pos + 5 + length]
        pos += 5 + length
    return bytes(out)


def refragment(records: bytes, record_size: int) -> bytes:
    """Re-split the handshake bytes into TLS records of at most `record_size` bytes."""
    hs = handshake_of(records)
    out = bytearray()
    for i in range(0, len(hs), record_size):
        chunk = hs[i : i + record_size]
        out += b"\x16\x03\x01" + struct.pack(">H", len(chunk)) + chunk
    return bytes(out)


def _ext(etype: int, data: bytes) -> bytes:
    return struct.pack(">HH", etype, len(data)) + data


def sni_ext(names: list[tuple[int, bytes]]) -> bytes:
    body = b"".join(struct.pack(">BH", t, len(n)) + n for t, n in names)
    return _ext(0, struct.pack(">H", len(body)) + body)


def synthetic_hello(exts: list[bytes], record_version: bytes = b"\x03\x01") -> bytes:
    """A minimal, well-formed ClientHello carrying exactly the given extensions."""
    body = (
        b"\x03\x03"
        + os.urandom(32)
        + b"\x00"  # no session id
        + b"\x00\x02\x13\x01"  # one cipher suite
        + b"\x01\x00"  # null compression
    )
    ext_bytes = b"".join(exts)
    body += struct.pack(">H", len(ext_bytes)) + ext_bytes
    hs = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16" + record_version + struct.pack(">H", len(hs)) + hs


def hello_with_sni(*names: str, ech: bool = False) -> bytes:
    exts = [sni_ext([(0, n.encode()) for n in names])] if names else []
    if ech:
        exts.append(_ext(0xFE0D, os.urandom(40)))
    return synthetic_hello(exts)
