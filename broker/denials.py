"""The broker's one refusal: an exception carrying the HTTP status, the stable reason code
and the message the sandbox sees. Raised by the request steps and the body limits
(body.py); the handlers turn it into the JSON denial (`deny_response`) and its event."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from stockade.policy.reasons import Reason

from .request import RequestError

if TYPE_CHECKING:
    from .audit import CallLog

log = logging.getLogger("stockade.broker")


class Denied(Exception):
    def __init__(self, status: int, reason: str, message: str, retry_after: float = 0) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after


@contextlib.contextmanager
def bad_request() -> Iterator[None]:
    """A malformed request (`RequestError` from the parsers) is a 400 `bad_request`
    carrying the parser's message."""
    try:
        yield
    except RequestError as e:
        raise Denied(400, Reason.BAD_REQUEST, str(e)) from None


def deny_response(cl: CallLog, d: Denied) -> web.Response:
    """`{"error": "denied", "reason", "message"}` plus `X-Stockade-Deny` (and `Retry-After`
    for a limit that frees up); the call's audit record takes the same reason."""
    cl.decision, cl.reason, cl.status = "denied", d.reason, d.status
    headers = {"X-Stockade-Deny": str(d.reason)}
    if d.retry_after > 0:
        headers["Retry-After"] = str(max(1, int(d.retry_after + 0.999)))
    return web.json_response(
        {"error": "denied", "reason": str(d.reason), "message": d.message},
        status=d.status, headers=headers,
    )


def internal(cl: CallLog, e: Exception) -> web.Response:
    """A bug, not a decision: fail closed with a fixed text. Only the exception's class
    is logged — messages (e.g. a URL carrying a query-injected key) never are."""
    log.error("internal error handling a call: %s", type(e).__name__)
    cl.extra["error"] = type(e).__name__
    return deny_response(cl, Denied(500, Reason.INTERNAL_ERROR, "internal error"))
