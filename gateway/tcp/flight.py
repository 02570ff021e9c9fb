"""The first flight: a connection's ClientHello or HTTP request head, and the bytes read.

`FirstFlight` is pure (bytes in, `Sniffed` out once the message is complete, or on an
error); `read_first_flight` only moves bytes from the socket into it until the deadline.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

from stockade.policy.reasons import Reason

from ..flow import Protocol
from ..relay import wait_fd
from ..sniff_common import NEED_MORE, SniffError
from ..sniff_http import HttpSniffer, RequestHead, looks_like_http
from ..sniff_tls import ClientHello, TlsSniffer, looks_like_tls

RECV_BYTES = 16384
_TIMED_OUT = "no complete ClientHello or request head before the deadline"


@dataclass
class Sniffed:
    data: bytes = b""  # every byte read so far (replayed upstream unchanged)
    tls: ClientHello | None = None
    http: RequestHead | None = None
    error: SniffError | None = None
    kind: Protocol | None = None  # the sniffer the first byte chose


class FirstFlight:
    """Collects the first message. `initial`: bytes already read (after a CONNECT head);
    `http_only`: an explicit-proxy request head (a ClientHello is not one)."""

    def __init__(self, cap: int, *, http_only: bool = False, initial: bytes = b"") -> None:
        self.cap = cap
        self.http_only = http_only
        self.buf = bytearray(initial)
        self.out = Sniffed(data=initial)
        self._sniffer: TlsSniffer | HttpSniffer | None = None

    def begin(self) -> Sniffed | None:
        """Sniff the initial bytes; None: more are needed."""
        return self._advance(bytes(self.buf))

    def feed(self, chunk: bytes) -> Sniffed | None:
        """One more chunk (non-empty); None: more are needed."""
        self.buf += chunk
        if len(self.buf) > 2 * self.cap + 64:
            return self._end(SniffError(Reason.HEAD_TOO_LARGE, "first message exceeds the cap"))
        return self._advance(chunk)

    def timeout(self) -> Sniffed:
        return self._end(SniffError(Reason.SNIFF_TIMEOUT, _TIMED_OUT))

    def closed(self) -> Sniffed:
        detail = "client closed before the first message was complete"
        return self._end(SniffError(Reason.PROTOCOL_UNRECOGNISED, detail))

    def _advance(self, chunk: bytes) -> Sniffed | None:
        if self.buf and self._sniffer is None:
            if looks_like_tls(self.buf) and not self.http_only:
                self._sniffer = TlsSniffer(self.cap)
                self.out.kind = "tls"
            elif looks_like_http(self.buf):
                self._sniffer = HttpSniffer(self.cap)
                self.out.kind = "http"
            else:
                return self._end(SniffError(Reason.PROTOCOL_UNRECOGNISED, "neither TLS nor HTTP"))
        if self._sniffer is None or not chunk:
            return None
        r = self._sniffer.feed(chunk)
        if r is NEED_MORE:
            return None
        if isinstance(r, SniffError):
            return self._end(r)
        if isinstance(r, ClientHello):
            self.out.tls = r
        elif isinstance(r, RequestHead):
            self.out.http = r
        return self._end(None)

    def _end(self, error: SniffError | None) -> Sniffed:
        if error is not None:
            self.out.error = error
        self.out.data = bytes(self.buf)
        return self.out


async def read_first_flight(
    sock: socket.socket,
    deadline: float,
    flight: FirstFlight,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Sniffed:
    """Read from `sock` into `flight` until it has a result or `deadline` passes
    (`loop`: the running loop, if the caller has it)."""
    loop = loop or asyncio.get_running_loop()
    done = flight.begin()
    while done is None:
        if deadline - loop.time() <= 0:
            return flight.timeout()
        try:
            try:
                chunk = sock.recv(RECV_BYTES)  # usually already there: no loop round
            except BlockingIOError:
                await wait_fd(loop, sock.fileno(), False, deadline)
                continue  # readable (or closed): the recv above reads it
        except TimeoutError:
            return flight.timeout()
        except OSError:
            chunk = b""
        done = flight.feed(chunk) if chunk else flight.closed()
    return done
