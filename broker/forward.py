"""One authorized call to its upstream, in three steps: `admit` (the grant's rate and
budget), `prepare` (route, credential, URL, headers) and `call` (the upstream request,
decoded, scrubbed and either buffered into a result or streamed back to a pass-through
caller). A step refuses with `Denied`; the call's `CallLog` says how far it got."""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.web_request import BaseRequest
from stockade.policy.model import ApiDefinition, BrokerGrant
from stockade.policy.reasons import Reason

from stockade.tasks import Task

from .audit import Auditor, CallLog
from .credentials import CredentialCache
from .decode import BodyDecoder, DecodeLimit, EncodingRefused, check_transfer_coding
from .denials import Denied
from .hosts import PinnedResolver
from .inject import strip_injected_query
from .limits import Budget, Limiter
from .request import LINK_HEADERS, CallRequest, build_url, filter_response_headers, rewrite_links
from .routes import ApiRoute, RouteTable
from .scrub import Patterns, StreamScrubber
from .settings import BrokerSettings
from .stream import CHUNK, AnswerHead, stream_back

SMALL_BODY = 256 * 1024  # pass-through answers up to this size are buffered, not streamed
# an upstream that failed mid-call: the caller sees a cut connection or one of these
_CALL_FAILED = (aiohttp.ClientError, TimeoutError, OSError, EncodingRefused, DecodeLimit)


@dataclass(frozen=True, slots=True)
class Prepared:
    """What `prepare` worked out for the upstream request."""

    route: ApiRoute
    url: str
    headers: list[tuple[str, str]]
    patterns: Patterns


def ssl_context(settings: BrokerSettings) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if settings.ca_file:
        ctx.load_verify_locations(settings.ca_file)
    return ctx


def open_session(settings: BrokerSettings,
                 resolver: AbstractResolver | None) -> aiohttp.ClientSession:
    """The upstream session; names resolve through pinned `broker.hosts` first, then the
    given (checked) resolver, else aiohttp's."""
    if settings.hosts:
        resolver = PinnedResolver(settings.hosts, fallback=resolver)
    connector = aiohttp.TCPConnector(
        ssl=ssl_context(settings), limit=settings.max_upstream_connections, resolver=resolver,
    )
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,  # decode.py decides: decode gzip/deflate or refuse
        timeout=aiohttp.ClientTimeout(total=settings.upstream_timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(),  # no state shared between tasks
        trust_env=False,
        skip_auto_headers=("User-Agent",),
    )


class Forwarder:
    def __init__(self, settings: BrokerSettings, limiter: Limiter, routes: RouteTable,
                 credentials: CredentialCache, auditor: Auditor,
                 clock: Callable[[], float]) -> None:
        self.settings = settings
        self.limiter = limiter
        self.routes = routes
        self.credentials = credentials
        self.auditor = auditor
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None  # set while serving

    async def forward(self, cl: CallLog, task: Task, api: ApiDefinition, grant: BrokerGrant,
                      call: CallRequest, passthrough: BaseRequest | None) -> dict[str, Any]:
        """The `/v1/call` result (passthrough None), else {} with the answer streamed
        into `cl.response`."""
        budget = self.admit(task, api, grant)
        prep = await self.prepare(cl, api, call)
        budget.charge_call()
        budget.charge_bytes(len(call.body))
        cl.bytes_up = len(call.body)
        if call.body:
            prep.route.metrics.bytes_up.inc(len(call.body))
        result, cut = await self.call(cl, api, call, prep, budget, passthrough)
        if cl.scrubs:
            self.auditor.secret_echo(cl, api.name, prep.route.metrics)
        if not cut:
            cl.decision, cl.reason = "allowed", Reason.ALLOWED_BY_RULE
        return result

    def admit(self, task: Task, api: ApiDefinition, grant: BrokerGrant) -> Budget:
        now = self.clock()
        bucket = self.limiter.bucket(task.task_id, api.name, grant.rate_per_second, grant.burst)
        wait = bucket.take(now)
        if wait > 0:
            raise Denied(429, Reason.RATE_LIMITED, "rate limit for this API exceeded", wait)
        budget = self.limiter.budget(task.task_id, api.name, grant.budget_calls, grant.budget_bytes)
        if budget.exhausted():
            raise Denied(403, Reason.BUDGET_EXHAUSTED, "the task's budget for this API is spent")
        return budget

    async def prepare(self, cl: CallLog, api: ApiDefinition, call: CallRequest) -> Prepared:
        route = self.routes.route(api)
        up = route.upstream
        if up is None:
            raise Denied(502, Reason.UPSTREAM_ERROR, "API definition unusable")
        cl.upstream = up
        if route.address_category is not None:
            cl.extra["address_category"] = route.address_category
            raise Denied(502, Reason.UPSTREAM_UNREACHABLE, "upstream address refused")
        cred = await self.credentials.fetch(api)
        query = strip_injected_query(call.query, api.injection) + cred.query
        url = build_url(up, call.path, query)
        return Prepared(route, url, [*call.headers, *cred.headers], cred.patterns)

    async def call(self, cl: CallLog, api: ApiDefinition, call: CallRequest, prep: Prepared,
                   budget: Budget, passthrough: BaseRequest | None) -> tuple[dict[str, Any], bool]:
        """(result, cut): `cut` when a streamed answer was cut after its headers went out."""
        assert self.session is not None
        t_up = time.perf_counter()
        left = budget.bytes_left()  # as charged for this call, before any answer bytes
        try:
            async with self.session.request(
                call.method, prep.url, headers=prep.headers, data=call.body or None,
                allow_redirects=False,
            ) as resp:
                return await self._answer(cl, resp, api, prep, budget, left, passthrough), False
        except Denied:
            raise
        except _CALL_FAILED as e:
            _failed(cl, e, passthrough)
            return {}, True
        finally:
            # observed by the audit, after the answer went out (bytes_down is final then)
            cl.upstream_s = time.perf_counter() - t_up
            cl.metrics = prep.route.metrics

    async def _answer(self, cl: CallLog, resp: aiohttp.ClientResponse, api: ApiDefinition,
                      prep: Prepared, budget: Budget, left: int | None,
                      passthrough: BaseRequest | None) -> dict[str, Any]:
        cl.status = resp.status
        try:
            check_transfer_coding(resp.headers.get("Transfer-Encoding"))
            decoder = BodyDecoder(resp.headers.get("Content-Encoding"),
                                  self.settings.max_decoded_bytes)
        except EncodingRefused:
            raise Denied(502, Reason.UPSTREAM_ERROR, "upstream used an unsupported "
                         "content coding") from None
        out_headers, n_h = _scrub_headers(resp.headers.items(), prep.patterns)
        if passthrough is not None and any(n.lower() in LINK_HEADERS for n, _ in out_headers):
            prefix = f"{passthrough.scheme}://{passthrough.host}/{api.name}"
            out_headers = rewrite_links(out_headers, api.base_url, prefix)
        # the reason phrase is upstream text the caller sees too (`401 bad key sk-...`)
        reason, n_r = prep.patterns.scrub_text(resp.reason) if resp.reason else (resp.reason, 0)
        head = AnswerHead(reason, out_headers)
        scrubber = StreamScrubber(prep.patterns)
        small = (resp.content_length is not None and resp.content_length <= SMALL_BODY
                 and decoder.coding == "identity")
        result: dict[str, Any] = {}
        if passthrough is not None and not small:
            await stream_back(cl, passthrough, resp, head, decoder, scrubber, left, budget)
        else:
            result = await self._buffered(cl, resp, decoder, scrubber, head, budget,
                                          left, passthrough, small)
        cl.scrubs = n_h + n_r + scrubber.count
        return result

    async def _buffered(self, cl: CallLog, resp: aiohttp.ClientResponse, decoder: BodyDecoder,
                        scrubber: StreamScrubber, head: AnswerHead,
                        budget: Budget, left: int | None,
                        passthrough: BaseRequest | None, small: bool) -> dict[str, Any]:
        """The whole answer read first: the `/v1/call` result, or a small known-length
        pass-through answer as one buffered response (no chunking)."""
        cap = self.settings.max_call_response_bytes if passthrough is None else None
        try:
            body = await _read_all(resp, decoder, scrubber, cap, left, small)
        except Denied as d:
            if d.reason == Reason.BUDGET_EXHAUSTED:
                budget.exhaust()
            raise
        result: dict[str, Any] = {}
        if passthrough is not None:
            cl.response = web.Response(status=resp.status, reason=head.reason,
                                       body=body, headers=head.headers)
        else:
            result = _call_result(resp.status, head.headers, body)
        budget.charge_bytes(len(body))
        cl.bytes_down = len(body)
        return result


def _failed(cl: CallLog, e: Exception, passthrough: BaseRequest | None) -> None:
    """The upstream failed: refuse, or (headers already sent) cut the connection so the
    caller sees a truncated body, never one that looks complete."""
    cl.extra["error"] = type(e).__name__
    if passthrough is not None and cl.response is not None:
        cut_budget = cl.extra.get("cut") == "budget"
        cl.decision = "denied"
        cl.reason = Reason.BUDGET_EXHAUSTED if cut_budget else Reason.UPSTREAM_ERROR
        if passthrough.transport is not None:
            passthrough.transport.abort()
        return
    if isinstance(e, TimeoutError | asyncio.TimeoutError):
        raise Denied(504, Reason.UPSTREAM_UNREACHABLE, "upstream timed out") from None
    raise Denied(502, Reason.UPSTREAM_UNREACHABLE, "upstream call failed") from None


def _scrub_headers(items: Any, patterns: Patterns) -> tuple[list[tuple[str, str]], int]:
    kept = filter_response_headers(items)
    values, n = patterns.scrub_texts([v for _, v in kept])
    if not n:
        return kept, 0
    return [(name, v) for (name, _), v in zip(kept, values, strict=True)], n


async def _read_all(
    resp: aiohttp.ClientResponse,
    decoder: BodyDecoder,
    scrubber: StreamScrubber,
    cap: int | None,
    budget_left: int | None,
    small: bool = False,
) -> bytes:
    limits = [x for x in (cap, budget_left) if x is not None]
    limit = min(limits) if limits else None
    if small:
        # known length, at most SMALL_BODY, not compressed: one read, one scrub pass
        # (no chunk iterator; the length was capped before a byte was buffered)
        body = scrubber.feed(decoder.feed(await resp.read()))
        parts = [body]
        size = len(body)
    else:
        parts = []
        size = 0
        async for chunk in resp.content.iter_chunked(CHUNK):
            data = scrubber.feed(decoder.feed(chunk))
            size += len(data)
            _check_size(size, limit, cap)
            parts.append(data)
    tail = scrubber.feed(decoder.flush()) + scrubber.flush()
    parts.append(tail)
    _check_size(size + len(tail), limit, cap)
    return b"".join(parts)


def _check_size(size: int, limit: int | None, cap: int | None) -> None:
    if limit is not None and size > limit:
        if cap is not None and size > cap:
            raise Denied(502, Reason.UPSTREAM_ERROR, "upstream response too large")
        raise Denied(403, Reason.BUDGET_EXHAUSTED,
                     "the task's byte budget for this API is spent")


def _call_result(status: int, headers: list[tuple[str, str]], body: bytes) -> dict[str, Any]:
    merged: dict[str, str] = {}
    for n, v in headers:
        key = n.lower()
        merged[key] = f"{merged[key]}, {v}" if key in merged else v
    out: dict[str, Any] = {"status": status, "headers": merged}
    try:
        out["body"] = body.decode("utf-8")
    except UnicodeDecodeError:
        out["body_base64"] = base64.b64encode(body).decode("ascii")
    return out
