"""Streaming decoding of a compressed upstream body before it is scrubbed.

The broker asks upstreams for `Accept-Encoding: identity`; one that compresses anyway
is decoded here (gzip, deflate) so the scrubber sees plaintext, or refused (anything
else) because a compressed echo of the key could not be scrubbed. Decoded output is
capped so a small compressed body cannot expand without bound.
"""

from __future__ import annotations

import zlib


class EncodingRefused(ValueError):
    """The upstream used a content coding the broker cannot decode."""


class DecodeLimit(ValueError):
    """Decoded output exceeded the cap."""


def check_transfer_coding(transfer_encoding: str | None) -> None:
    """Refuse an answer framed with a transfer coding other than chunked: aiohttp removes
    the chunking but never decodes gzip/deflate/compress there, so a `Transfer-Encoding:
    gzip, chunked` echo of the key would reach the caller compressed, past the scrubber."""
    if not transfer_encoding:
        return
    codings = {c.strip(" \t").lower() for c in transfer_encoding.split(",")}
    if not codings <= {"chunked", "identity"}:
        raise EncodingRefused("transfer coding other than chunked")


class BodyDecoder:
    def __init__(self, content_encoding: str | None, max_output: int) -> None:
        self.max_output = max_output
        self.produced = 0
        self._z: zlib._Decompress | None = None  # type: ignore[name-defined]
        self._deflate_sniffed = False
        self._pending = b""
        if not content_encoding:  # the usual answer to `Accept-Encoding: identity`
            self.coding = "identity"
            return
        codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
        codings = [c for c in codings if c != "identity"]
        if len(codings) > 1:
            raise EncodingRefused("stacked content codings")
        self.coding = codings[0] if codings else "identity"
        if self.coding in ("gzip", "x-gzip"):
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif self.coding == "deflate":
            self._z = None  # zlib-wrapped or raw: decided on the first bytes
        elif self.coding != "identity":
            raise EncodingRefused(f"content coding {self.coding!r} not supported")

    def _take(self, out: bytes) -> bytes:
        self.produced += len(out)
        if self.produced > self.max_output:
            raise DecodeLimit("decoded body too large")
        return out

    def feed(self, chunk: bytes) -> bytes:
        if self.coding == "identity":
            return self._take(chunk)
        if self.coding == "deflate" and self._z is None:
            self._pending += chunk
            if len(self._pending) < 2:
                return b""
            # RFC 9110 says zlib format; some servers send raw deflate
            cmf, flg = self._pending[0], self._pending[1]
            zlib_wrapped = (cmf & 0x0F) == 8 and ((cmf << 8) | flg) % 31 == 0
            self._z = zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)
            chunk, self._pending = self._pending, b""
        assert self._z is not None
        try:
            # bounded output per call: never inflate more than the remaining allowance + 1
            out = self._z.decompress(chunk, self.max_output - self.produced + 1)
            if self._z.unconsumed_tail:
                raise DecodeLimit("decoded body too large")
        except zlib.error:
            raise EncodingRefused("corrupt compressed body") from None
        return self._take(out)

    def flush(self) -> bytes:
        if self._z is None:
            if self._pending:
                raise EncodingRefused("truncated compressed body")
            return b""
        try:
            return self._take(self._z.flush())
        except zlib.error:
            raise EncodingRefused("corrupt compressed body") from None
