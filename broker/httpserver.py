"""The broker's HTTP/1 listener: aiohttp plus a deadline for request heads and
denial-shaped answers to heads aiohttp refuses.

aiohttp parses a request head before any handler or middleware runs, so two things
never reach `Broker`'s handlers: a head that never completes (slow-loris: a client
trickling header lines to hold a connection and a task slot forever) and a head the
parser rejects (too long, too many headers, malformed). aiohttp itself has no head
deadline (its keep-alive timer only closes idle connections, after an hour by default)
and answers parse errors with a text page that quotes the offending bytes, logged with
a traceback. `GuardedRequestHandler` closes both gaps; the pure helpers below decide
what to answer, the handler only keeps a timer and moves bytes.

The handler reads two private attributes of aiohttp's `RequestHandler` (`_waiter`,
`_messages`) to know whether it is waiting for a head; aiohttp's own keep-alive timer
uses the same test. tests/broker/test_http_guard.py pins this against the installed
aiohttp, so an upgrade that changes them fails the tests instead of silently
disabling the deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from stockade.policy.reasons import Reason

log = logging.getLogger("stockade.broker")

HEAD_TIMEOUT_MESSAGE = "request head not received in time"
BODY_TIMEOUT_MESSAGE = "request body not received in time"
_STATUS_TEXT = {400: "Bad Request", 408: "Request Timeout",
                431: "Request Header Fields Too Large", 500: "Internal Server Error"}


class HeadGuard(Protocol):
    """Who is told about a request that was refused before any handler saw it."""

    def head_denied(self, source_ip: str, status: int, reason: str, error: str) -> None:
        """`error`: the parser's exception class name, "" for a head that timed out."""


@dataclass(frozen=True, slots=True)
class HeadLimits:
    header_timeout_s: float  # the whole head, from connect (first request) or first byte
    max_line_size: int  # request line
    max_field_size: int  # one header name or value
    max_headers: int  # header lines


# aiohttp's own fixed texts for a head with too many lines; matched whole and on the
# exact class, since subclasses (InvalidHeader, ...) and parser errors quote the caller
_TOO_MANY_MESSAGES = frozenset({"Too many headers received", "Too many trailers received"})


# -- pure: what to answer ----------------------------------------------------------------
def classify_head_error(status: int, exc: BaseException | None) -> tuple[int, str, str]:
    """aiohttp's (status, exception) for a request no handler saw -> (status, reason,
    fixed message). The exception's text quotes the caller's bytes: it never goes out."""
    if isinstance(exc, LineTooLong) or (
        type(exc) is BadHttpMessage and exc.message in _TOO_MANY_MESSAGES
    ):
        return 431, Reason.HEAD_TOO_LARGE, "request head too large"
    if isinstance(exc, HttpProcessingError):
        return 400, Reason.BAD_REQUEST, "malformed request"
    return 500, Reason.INTERNAL_ERROR, "internal error"


def denial_body(reason: str, message: str) -> bytes:
    """The JSON body every broker denial carries (same shape as `Broker._deny`)."""
    return json.dumps({"error": "denied", "reason": str(reason), "message": message}).encode()


def raw_denial(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 denial, for when no aiohttp response object can be used
    (the head never completed, so there is no request to answer through)."""
    body = denial_body(reason, message)
    head = (
        f"HTTP/1.1 {status} {_STATUS_TEXT.get(status, 'Error')}\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"X-Stockade-Deny: {reason}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def peer_ip(peername: Any) -> str:
    if isinstance(peername, tuple) and peername:
        return str(peername[0])
    return ""


# -- the I/O shell -------------------------------------------------------------------------
class GuardedRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol with a head deadline.

    The timer is armed while a head is in progress: at connect (so a connection that
    never sends a complete head is closed too) and at the first bytes of each further
    keep-alive request unless they already complete its head; it is disarmed as soon as
    the parser has a complete head (or a parse error). The body has its own deadline in
    the handlers (`Broker`), where the task is known.
    """

    __slots__ = ("_guard", "_head_timeout", "_head_timer")

    def __init__(self, manager: Any, *, guard: HeadGuard, header_timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._head_timeout = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    # head deadline
    def _waiting_for_head(self) -> bool:
        waiter = self._waiter
        return not self._messages and waiter is not None and not waiter.done()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self._loop.call_later(self._head_timeout, self._head_expired)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages:
            self._disarm()  # a complete head (or a parse error) is queued for the handler
        elif data and self._head_timer is None and self._waiting_for_head():
            # first bytes of a keep-alive request and its head is still incomplete: it
            # is now on the clock. A head that arrived whole (the usual case) never
            # needed a timer, so none is armed and cancelled for it.
            self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_expired(self) -> None:
        self._head_timer = None
        transport = self.transport
        # a complete head may have arrived in the same loop turn; only a head still in
        # progress (aiohttp waiting for its next message) is cut
        if transport is None or self._force_close or not self._waiting_for_head():
            return
        ip = peer_ip(transport.get_extra_info("peername"))
        log.info("request head from %s not complete after %.1f s: closing", ip,
                 self._head_timeout)
        try:
            self._guard.head_denied(ip, 408, Reason.REQUEST_TIMEOUT, "")
        finally:
            # the client may still read a legible denial; then the connection goes
            transport.write(raw_denial(408, Reason.REQUEST_TIMEOUT, HEAD_TIMEOUT_MESSAGE))
            self.force_close()

    # refused heads: a JSON denial and an event instead of aiohttp's text page
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # same contract as aiohttp's: a started response cannot become an error page
            raise ConnectionError("response already started")
        code, reason, text = classify_head_error(status, exc)
        ip = peer_ip(self.peername)
        if isinstance(exc, HttpProcessingError):
            # only the class: the message quotes up to 100 bytes of the caller's head
            log.info("refused a request head from %s: %s", ip, type(exc).__name__)
            self._guard.head_denied(ip, code, reason, type(exc).__name__)
        else:
            log.error("error handling a request from %s: %s", ip,
                      type(exc).__name__ if exc else status)
        resp = web.Response(status=code, body=denial_body(reason, text),
                            content_type="application/json",
                            headers={"X-Stockade-Deny": str(reason)})
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """`web.Server` whose connections are `GuardedRequestHandler`s."""

    def __init__(self, *args: Any, guard: HeadGuard, header_timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard = guard
        self._header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        # no fallback to default kwargs (aiohttp's own __call__ has one): limits that
        # silently vanish are worse than a server that refuses to start
        return GuardedRequestHandler(self, guard=self._guard,
                                     header_timeout_s=self._header_timeout_s,
                                     loop=self._loop, **self._kwargs)


class GuardedRunner(web.BaseRunner):
    """Serves one request handler through `GuardedServer` with explicit head limits:
    aiohttp's low-level server (no Application, router or middlewares), with the
    request body cap (`client_max_size`) an Application would have applied and start-up
    / clean-up hooks in its place."""

    __slots__ = ("_client_max_size", "_guard", "_handler", "_limits", "_on_cleanup",
                 "_on_startup")

    def __init__(self, handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]], *,
                 guard: HeadGuard, limits: HeadLimits, client_max_size: int,
                 on_startup: Callable[[], Awaitable[None]] | None = None,
                 on_cleanup: Callable[[], Awaitable[None]] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._handler = handler
        self._guard = guard
        self._limits = limits
        self._client_max_size = client_max_size
        self._on_startup = on_startup
        self._on_cleanup = on_cleanup

    async def _make_server(self) -> web.Server:
        if self._on_startup is not None:
            await self._on_startup()
        loop = asyncio.get_running_loop()
        max_size = self._client_max_size

        def make_request(message: Any, payload: Any, protocol: Any, writer: Any,
                         task: Any) -> BaseRequest:
            return BaseRequest(message, payload, protocol, writer, task, loop,
                               client_max_size=max_size)

        lim = self._limits
        return GuardedServer(self._handler, request_factory=make_request, guard=self._guard,
                             header_timeout_s=lim.header_timeout_s,
                             max_line_size=lim.max_line_size,
                             max_field_size=lim.max_field_size,
                             max_headers=lim.max_headers, **self._kwargs)

    async def shutdown(self) -> None:
        pass

    async def _cleanup_server(self) -> None:
        if self._on_cleanup is not None:
            await self._on_cleanup()
