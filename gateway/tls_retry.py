"""Incremental, pure watcher of a TLS HelloRetryRequest at the start of a spliced tunnel.

An uninspected TLS flow is decided on its first ClientHello's SNI. If the server answers
with a HelloRetryRequest (RFC 8446 4.1.3, a ServerHello whose `random` is SHA-256 of
"HelloRetryRequest"), the client sends a second ClientHello in plaintext, and a shared
front-end routes by the name in that one: a client that provokes a retry could name
another site there (fronting past the gateway's decision). This watcher sees the server's
first handshake message, and after a retry the client's next bytes: at most one
middlebox-compatibility ChangeCipherSpec record, then the second ClientHello, which must
name the same host (normalised as the decision's: `stockade.policy.normalize_host`), carry
no encrypted name and no IP literal.

Hand-written for the reasons of `sniff_tls.py`: sans-IO (bytes in, verdict out),
incremental across TCP segments and TLS records (a record header may be split anywhere,
the server's message may be fragmented over records), strict (anything unexpected is
refused), and cheap on the common path (a first chunk that holds a whole ServerHello
head is judged without copying). No TLS library exposes this without terminating TLS.

Usage: `w = RetryWatch(host, max_bytes)`; `w.server(chunk)` until it is not NEED_MORE
(NO_RETRY: stop watching; RETRY: then) `w.client(chunk)` until it is not NEED_MORE (OK:
forward what was held and stop watching). A `Refused` is final: close both sides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from stockade.policy import HostError, normalize_host
from stockade.policy.reasons import Reason

from .sniff_common import NEED_MORE, NeedMore, SniffError
from .sniff_tls import HANDSHAKE, MAX_RECORD, ClientHello, TlsSniffer

# SHA-256("HelloRetryRequest"): the ServerHello.random of a HelloRetryRequest
HRR_RANDOM = bytes.fromhex("CF21AD74E59A6111BE1D8C021E65B891C2A211167ABB8C5E079E09E2C8A8339C")
# the compatibility-mode ChangeCipherSpec record (RFC 8446 D.4): the only one accepted
CCS_RECORD = b"\x14\x03\x03\x00\x01\x01"
SERVER_HELLO = 0x02
# handshake type (1) + length (3) + legacy_version (2) + random (32)
SERVER_HEAD = 38
_RANDOM_AT = 6


class Step(enum.Enum):
    NEED_MORE = "need_more"
    NO_RETRY = "no_retry"  # the server's first message is no retry: stop watching
    RETRY = "retry"  # a HelloRetryRequest: judge the client's next bytes
    OK = "ok"  # the second ClientHello names the decided host: stop watching


@dataclass(frozen=True, slots=True)
class Refused:
    reason: Reason  # destination_mismatch: the second hello names another destination
    detail: str  # short, for the event message; never contains payload bytes


def _mismatch(detail: str) -> Refused:
    return Refused(Reason.DESTINATION_MISMATCH, f"after a HelloRetryRequest: {detail}")


def first_hello_end(data: bytes, hello_size: int) -> int | Refused:
    """Where the records holding the first ClientHello (`hello_size` handshake bytes, as
    the sniffer parsed them from the start of `data`) end in `data`: the bytes after it
    are held until the server answered. More handshake bytes after the hello inside its
    last record could not be held apart from it: refused."""
    pos = got = 0
    while got < hello_size:  # the sniffer walked these records: their headers are sound
        length = int.from_bytes(data[pos + 3 : pos + 5], "big")
        got += length
        pos += 5 + length
    if got != hello_size:
        detail = "more handshake bytes after the ClientHello inside its record"
        return Refused(Reason.PROTOCOL_UNRECOGNISED, detail)
    return pos


class RetryWatch:
    """The start of one spliced TLS tunnel. `host`: the flow's decided host, i.e. the
    first ClientHello's SNI through `normalize_host`; `max_bytes`: the sniff cap."""

    __slots__ = ("_hdr", "_hs", "_left", "_pre", "_result", "_retry", "_sniffer", "host",
                 "max_bytes")

    def __init__(self, host: str, max_bytes: int) -> None:
        self.host = host
        self.max_bytes = max_bytes
        self._hdr = bytearray()  # a server record header not yet complete
        self._left = 0  # bytes of the current server record's body not yet seen
        self._hs = bytearray()  # the server's first handshake bytes (up to SERVER_HEAD)
        self._retry = False  # the server asked for a retry: the client side is judged
        self._pre = bytearray()  # client bytes before the hello (a CCS record or part)
        self._sniffer: TlsSniffer | None = None  # the second ClientHello
        self._result: Step | Refused | None = None

    # -- the server's first handshake message ------------------------------------------
    def server(self, data: bytes | bytearray | memoryview) -> Step | Refused:
        """Feed the server's next bytes; NEED_MORE until its first message is judged."""
        if self._retry or self._result is not None:
            return self._result if self._result is not None else Step.RETRY
        if not self._hs and not self._hdr and self._left == 0:
            fast = _whole_head(data)
            if fast is not None:
                return self._server_done(fast)
        return self._server_done(self._server_feed(memoryview(data)))

    def _server_done(self, step: Step | Refused) -> Step | Refused:
        if step is Step.RETRY:
            self._retry = True
        elif step is not Step.NEED_MORE:
            self._result = step
        return step

    def _server_feed(self, data: memoryview) -> Step | Refused:
        pos, end = 0, len(data)
        while pos < end:
            if self._left == 0:  # inside a record header
                take = min(5 - len(self._hdr), end - pos)
                self._hdr += data[pos : pos + take]
                pos += take
                step = self._server_header()
                if step is not None:
                    return step
                continue
            take = min(self._left, end - pos, SERVER_HEAD - len(self._hs))
            self._hs += data[pos : pos + take]
            pos += take
            self._left -= take
            step = self._server_message()
            if step is not None:
                return step
        return Step.NEED_MORE

    def _server_header(self) -> Step | Refused | None:
        """Check the (partial) record header; None: go on (a complete one opened a body)."""
        hdr = self._hdr
        if hdr[0] != HANDSHAKE:
            if not self._hs:  # no handshake at all (an alert, not TLS): nothing to watch
                return Step.NO_RETRY
            detail = "another record inside the server's first handshake message"
            return Refused(Reason.PROTOCOL_UNRECOGNISED, detail)
        if len(hdr) >= 2 and hdr[1] != 3:
            return Refused(Reason.PROTOCOL_UNRECOGNISED, "bad record version from the server")
        if len(hdr) < 5:
            return None
        length = int.from_bytes(hdr[3:5], "big")
        if length == 0 or length > MAX_RECORD:
            return Refused(Reason.PROTOCOL_UNRECOGNISED, "bad record length from the server")
        self._left = length
        hdr.clear()
        return None

    def _server_message(self) -> Step | Refused | None:
        hs = self._hs
        if hs[0] != SERVER_HELLO:
            return Step.NO_RETRY  # not a ServerHello, so no retry: nothing to watch
        if len(hs) >= 4 and int.from_bytes(hs[1:4], "big") < SERVER_HEAD - 4:
            return Refused(Reason.PROTOCOL_UNRECOGNISED, "truncated ServerHello")
        if len(hs) < SERVER_HEAD:
            return None
        return Step.RETRY if hs[_RANDOM_AT:SERVER_HEAD] == HRR_RANDOM else Step.NO_RETRY

    # -- after a retry: the client's second ClientHello ---------------------------------
    def client(self, data: bytes | bytearray | memoryview) -> Step | Refused | NeedMore:
        """Feed the client's next bytes after a RETRY; NEED_MORE until they are judged."""
        if self._result is not None:
            return self._result
        if not self._retry:
            raise RuntimeError("client bytes are judged only after a HelloRetryRequest")
        if self._sniffer is None:
            self._pre += data
            rest = self._before_hello()
            if rest is None:
                return NEED_MORE
            if isinstance(rest, Refused):
                self._result = rest
                return rest
            data = rest
            if not data:
                return NEED_MORE
        assert self._sniffer is not None
        result = self._judge(self._sniffer.feed(bytes(data)))
        if not isinstance(result, NeedMore):
            self._result = result
        return result

    def _before_hello(self) -> bytes | Refused | None:
        """At most one CCS record, exactly; then the rest goes to a fresh TlsSniffer.
        None: not enough bytes to tell."""
        pre = self._pre
        if not pre:
            return None
        if pre[0] == CCS_RECORD[0]:
            if not CCS_RECORD.startswith(pre[: len(CCS_RECORD)]):
                detail = "a ChangeCipherSpec record other than the compatibility one"
                return Refused(Reason.PROTOCOL_UNRECOGNISED, f"after a HelloRetryRequest: {detail}")
            if len(pre) < len(CCS_RECORD):
                return None
            rest = bytes(pre[len(CCS_RECORD) :])
        else:
            rest = bytes(pre)
        self._pre = bytearray()
        self._sniffer = TlsSniffer(self.max_bytes)
        return rest

    def _judge(self, r: NeedMore | ClientHello | SniffError) -> Step | Refused | NeedMore:
        if isinstance(r, NeedMore):
            return NEED_MORE
        if isinstance(r, SniffError):
            reason, detail = r.reason, r.detail
            if reason in (Reason.SNI_MISSING, Reason.INVALID_HOST):
                return _mismatch(f"second ClientHello: {detail}")
            return Refused(reason, f"after a HelloRetryRequest: {detail}")
        if r.ech:
            return _mismatch("the second ClientHello carries an encrypted name (ECH)")
        if r.sni is None:
            return _mismatch("the second ClientHello names no host")
        if r.sni_is_ip:
            return _mismatch("the second ClientHello names an IP literal")
        try:
            host = normalize_host(r.sni)
        except HostError:
            return _mismatch("the second ClientHello names an invalid host")
        if host != self.host:
            return _mismatch(f"the second ClientHello names {host}, the first {self.host}")
        return Step.OK


def _whole_head(data: bytes | bytearray | memoryview) -> Step | None:
    """The common case, judged in place: one handshake record whose body starts with a
    whole ServerHello head. None: anything else (the incremental path decides)."""
    if len(data) < 5 + SERVER_HEAD or data[0] != HANDSHAKE or data[1] != 3:
        return None
    length = (data[3] << 8) | data[4]
    if length < SERVER_HEAD or length > MAX_RECORD or data[5] != SERVER_HELLO:
        return None
    if ((data[6] << 16) | (data[7] << 8) | data[8]) < SERVER_HEAD - 4:
        return None
    return Step.RETRY if data[5 + _RANDOM_AT : 5 + SERVER_HEAD] == HRR_RANDOM else Step.NO_RETRY
