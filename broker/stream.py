"""Bodies on the wire: the caller's request body within its limits (`read_body`), an
upstream answer streamed back to a pass-through caller, scrubbed, within the task's byte
budget (`stream_back`), and how a refused or failed call's connection ends
(`deny_request`, `fail_request`). Only moves bytes; the limits and the scrubbing are
decided elsewhere (body.py, decode.py, scrub.py)."""

from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple

import aiohttp
from aiohttp import web
from aiohttp.web_request import BaseRequest
from stockade.policy.reasons import Reason

from .audit import CallLog
from .body import Reservation, body_unread, read_within
from .decode import BodyDecoder, DecodeLimit
from .denials import Denied, deny_response, internal
from .httpserver import BODY_TIMEOUT_MESSAGE
from .limits import Budget
from .scrub import StreamScrubber

CHUNK = 64 * 1024

log = logging.getLogger("stockade.broker")


async def read_body(request: BaseRequest, limit: int, res: Reservation,
                    timeout_s: float) -> bytes:
    """The body within `limit` and the task's body budget (broker/body.py)."""
    try:
        return await read_within(request, limit, res, timeout_s)
    except TimeoutError:  # a BodyLimit is a Denied already
        raise Denied(408, Reason.REQUEST_TIMEOUT, BODY_TIMEOUT_MESSAGE) from None


class AnswerHead(NamedTuple):
    """The upstream answer's reason phrase and headers, filtered and scrubbed."""

    reason: str | None
    headers: list[tuple[str, str]]


async def stream_back(
    cl: CallLog,
    request: BaseRequest,
    resp: aiohttp.ClientResponse,
    head: AnswerHead,
    decoder: BodyDecoder,
    scrubber: StreamScrubber,
    budget_left: int | None,
    budget: Budget,
) -> None:
    out = web.StreamResponse(status=resp.status, reason=head.reason)
    for n, v in head.headers:
        out.headers.add(n, v)
    await out.prepare(request)
    cl.response = out
    sent = 0
    try:
        async for chunk in resp.content.iter_chunked(CHUNK):
            data = scrubber.feed(decoder.feed(chunk))
            if budget_left is not None and sent + len(data) > budget_left:
                cl.extra["cut"] = "budget"
                budget.exhaust()
                raise DecodeLimit("byte budget exhausted mid-response")
            if data:
                await out.write(data)
                sent += len(data)
        data = scrubber.feed(decoder.flush()) + scrubber.flush()
        if data:
            await out.write(data)
            sent += len(data)
        await out.write_eof()
    finally:
        cl.bytes_down = sent
        budget.charge_bytes(sent)
        if sent and cl.scrubs == 0:
            cl.scrubs = scrubber.count


async def deny_request(request: BaseRequest, cl: CallLog, d: Denied) -> web.Response:
    """The denial, and for a body that timed out also close the connection right after
    the answer: the rest of that body is not worth aiohttp's lingering read (it would
    keep reading a trickling client for `lingering_time` more)."""
    resp = deny_response(cl, d)
    timed_out = d.reason == Reason.REQUEST_TIMEOUT
    # a refused body still on its way (or never sent: no 100 Continue) is not drained
    if timed_out or body_unread(request):
        if timed_out:
            cl.extra["phase"] = "body"
        with contextlib.suppress(ConnectionError):
            await resp.prepare(request)
            await resp.write_eof()
        request.protocol.force_close()
    return resp


def fail_request(request: BaseRequest, cl: CallLog, e: Exception) -> web.StreamResponse:
    """A bug while handling a call: the fixed 500, or mid-stream (headers already sent)
    a cut connection."""
    if cl.response is not None and cl.response.prepared:
        # log the class only, never the message
        log.error("internal error mid-stream: %s", type(e).__name__)
        cl.extra["error"] = type(e).__name__
        cl.decision, cl.reason = "denied", Reason.INTERNAL_ERROR
        if request.transport is not None:
            request.transport.abort()
        return cl.response
    return internal(cl, e)
