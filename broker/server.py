"""The broker's asyncio shell: aiohttp in, policy + Vault + injection, aiohttp out.

Every decision is made by the pure modules (`request`, `inject`, `limits`, `scrub`,
`decode`, `stockade.policy.match_operation`); this module only moves bytes, keeps the
per-task state and writes one `broker_call` event per call. Denials are JSON
`{"error": "denied", "reason": <code>, "message": ...}` plus an `X-Stockade-Deny` header.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.http import HttpVersion11
from aiohttp.web_request import BaseRequest
from stockade.policy.model import ApiDefinition, BrokerGrant, Profile
from stockade.policy.reasons import Reason

from stockade.events import EventWriter, make_event
from stockade.tasks import Task, TaskRegistry

from .body import (
    BodyBudget,
    Reservation,
    body_unread,
    call_doc_limit,
    defer_continue,
    inflated,
    read_within,
)
from .decode import BodyDecoder, DecodeLimit, EncodingRefused
from .denials import Denied
from .hosts import PinnedResolver
from .httpserver import BODY_TIMEOUT_MESSAGE, GuardedRunner, HeadLimits
from .inject import inject, strip_injected_query
from .limits import InFlight, Limiter
from .metrics import ApiMetrics, BrokerMetrics
from .request import (
    LINK_HEADERS,
    CallRequest,
    RequestError,
    Upstream,
    build_url,
    encode_query,
    filter_response_headers,
    parse_base_url,
    parse_call_doc,
    parse_passthrough,
    rewrite_links,
)
from .scrub import Patterns, StreamScrubber
from .settings import BrokerSettings
from .vault import SecretValue, VaultUnavailable

log = logging.getLogger("stockade.broker")

CHUNK = 64 * 1024
SMALL_BODY = 256 * 1024  # pass-through answers up to this size are buffered, not streamed
UPSTREAM_ERROR = "upstream_error"  # reason for an upstream that failed mid-call (502)
INTERNAL_ERROR = "internal_error"  # a broker bug: 500, fixed text, class name logged


class Rules(Protocol):
    """What the broker reads of a `stockade.policy.RuleSet`."""

    @property
    def version(self) -> str: ...
    @property
    def profiles(self) -> Mapping[str, Profile]: ...
    @property
    def apis(self) -> Mapping[str, ApiDefinition]: ...


class AddressCheck(Protocol):
    """`stockade.gateway.addresses.AddressPolicy`: None = may dial, else the category."""

    def check(self, ip: Any) -> str | None: ...


class SecretSource(Protocol):
    async def get(self, cred: Any) -> SecretValue: ...

    # optional: `fresh(cred) -> SecretValue | None`, a cache hit without a coroutine


@dataclass(frozen=True, slots=True)
class ApiRoute:
    """What a call needs of one API definition that does not change between calls:
    worked out once per definition (a reload brings new definition objects)."""

    api: ApiDefinition
    upstream: Upstream | None  # None: the base URL is unusable
    address_category: str | None  # an IP-literal host the address check refuses
    metrics: ApiMetrics


@dataclass(frozen=True, slots=True)
class Credential:
    """One secret rendered for one API's injection, with its scrub patterns; cached so a
    call does not re-render headers or recompile patterns."""

    headers: tuple[tuple[str, str], ...]  # injected headers + forced Accept-Encoding
    query: tuple[str, ...]  # encoded injected query parts
    patterns: Patterns


@dataclass(slots=True)
class CallLog:
    """What the audit event of one call says; filled in as the call progresses."""

    t0: float
    source_ip: str
    task: Task | None = None
    api: str | None = None
    method: str | None = None
    path: str | None = None
    upstream: Upstream | None = None
    status: int | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    decision: str = "denied"
    reason: str = Reason.BAD_REQUEST
    scrubs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    response: web.StreamResponse | None = None  # pass-through: the prepared stream
    upstream_s: float | None = None  # the upstream call took this long (when made)
    metrics: ApiMetrics | None = None  # the API's metric children (when called)


class Broker:
    def __init__(
        self,
        settings: BrokerSettings,
        rules: Rules,
        secrets: SecretSource,
        registry: TaskRegistry,
        events: EventWriter,
        metrics: BrokerMetrics | None = None,
        *,
        load_rules: Callable[[], Rules] | None = None,
        clock: Callable[[], float] = time.monotonic,
        resolver: AbstractResolver | None = None,
        address_policy: AddressCheck | None = None,
    ) -> None:
        self.settings = settings
        self.rules = rules
        self.secrets = secrets
        self.registry = registry
        self.events = events
        self.metrics = metrics or BrokerMetrics()
        self._load_rules = load_rules
        self.clock = clock
        self._resolver = resolver
        # IP-literal base URLs skip any resolver: check them here (same rules as names)
        self._address_policy = address_policy
        self.limiter = Limiter()
        self.inflight = InFlight(settings.max_concurrent_calls_per_task)
        self.bodies = BodyBudget(settings.max_body_bytes_in_flight_per_task)
        self._credentials: OrderedDict[tuple[Any, ...], Credential] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self._routes: dict[str, ApiRoute] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once known
        self._fresh: Callable[[Any], SecretValue | None] | None = getattr(
            secrets, "fresh", None)
        # match_operation answers per (grant, method, path): pure, and a task repeats its
        # calls; keyed by the grant object's id (a reload brings new ones), bounded
        self._op_cache: OrderedDict[tuple[int, str, str], tuple[BrokerGrant, bool]] = (
            OrderedDict())
        registry.on_removed(lambda t: self.limiter.forget(t.task_id))
        self.metrics.track_dropped(lambda: events.dropped)

    # -- lifecycle ---------------------------------------------------------------------
    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        if self.settings.ca_file:
            ctx.load_verify_locations(self.settings.ca_file)
        return ctx

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                ssl=self.ssl_context(), limit=self.settings.max_upstream_connections,
                resolver=self._make_resolver(),
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,  # decode.py decides: decode gzip/deflate or refuse
                timeout=aiohttp.ClientTimeout(total=self.settings.upstream_timeout_s),
                cookie_jar=aiohttp.DummyCookieJar(),  # no state shared between tasks
                trust_env=False,
                skip_auto_headers=("User-Agent",),
            )

    def _make_resolver(self) -> AbstractResolver | None:
        """Pinned `broker.hosts` first, then the given (checked) resolver, else aiohttp's."""
        if self.settings.hosts:
            return PinnedResolver(self.settings.hosts, fallback=self._resolver)
        return self._resolver

    async def close(self) -> None:
        self._loop = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def app(self) -> web.Application:
        """`handle` as an aiohttp Application (for embedding next to other routes); the
        broker itself serves `runner()`, which skips the Application layer."""
        app = web.Application(client_max_size=self.settings.max_request_bytes)
        # `handle` answers Expect itself (the router's default handler would too)
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=_no_expect)

        async def on_startup(_app: web.Application) -> None:
            await self.start()

        async def on_cleanup(_app: web.Application) -> None:
            await self.close()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    def runner(self, **kwargs: Any) -> web.BaseRunner:
        """`handle` behind the guarded HTTP/1 listener (head deadline, explicit head size
        limits, denial events for heads no handler sees); serve it with `web.TCPSite`.
        aiohttp's low-level server: no Application, router or middleware chain per call."""
        s = self.settings
        limits = HeadLimits(header_timeout_s=s.request_header_timeout_s,
                            max_line_size=s.max_request_line_bytes,
                            max_field_size=s.max_header_field_bytes,
                            max_headers=s.max_header_count)
        return GuardedRunner(self.handle, guard=self, limits=limits,
                             client_max_size=s.max_request_bytes,
                             on_startup=self.start, on_cleanup=self.close,
                             keepalive_timeout=s.keepalive_timeout_s, **kwargs)

    def _audit_soon(self, cl: CallLog) -> None:
        """Write the call's audit event right after the answer went out: building and
        writing it is ~30 us that need not sit on the caller's latency; the callback runs
        on the loop's next turn, before any later I/O."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        loop.call_soon(self._audit, cl)

    def head_denied(self, source_ip: str, status: int, reason: str, error: str) -> None:
        """`HeadGuard`: a request refused before any handler ran (head too slow, too large
        or malformed) still gets its `broker_call` event, with the task when known."""
        cl = CallLog(self.clock(), source_ip, status=status, reason=reason)
        cl.task = self.registry.by_address(source_ip) if source_ip else None
        cl.extra["phase"] = "head"
        if error:
            cl.extra["error"] = error  # the parser's exception class, never its text
        self._audit(cl)

    # -- rule reload (SIGHUP and the control API) -----------------------------------------
    async def reload(self, trigger: str = "control") -> dict[str, Any]:
        """Load and swap the rules; on any problem keep the old ones (same event fields and
        reason codes as the gateway's reload: `rules_loaded` / `rules_invalid`)."""
        if self._load_rules is None:
            return {"ok": False, "error": "no rule source"}
        old = self.rules.version
        try:
            new = await asyncio.get_running_loop().run_in_executor(None, self._load_rules)
        except Exception as e:  # RulesError and friends: keep serving with the old rules
            problems = [str(p) for p in getattr(e, "problems", [])][:20] or [
                type(e).__name__]
            self.metrics.reloads.labels("failure").inc()
            self.events.write(make_event(
                component="broker", action="rules_reload", decision="denied",
                reason="rules_invalid", policy_version=old,
                message=f"rule reload ({trigger}) refused; previous rules stay in force",
                extra={"problems": problems, "trigger": trigger},
            ))
            log.warning("rule reload (%s) refused, keeping version %s", trigger, old)
            return {"ok": False, "version": old, "problems": problems}
        self.rules = new  # one reference swap: a call sees the old or the new rules
        # stale entries would be rebuilt or missed anyway (keyed by object); clearing
        # lets the old rule objects go
        self._routes.clear()
        self._op_cache.clear()
        self.metrics.reloads.labels("success").inc()
        self.events.write(make_event(
            component="broker", action="rules_reload", decision="allowed",
            reason="rules_loaded", policy_version=new.version,
            message=f"rules reloaded ({trigger}): {old} -> {new.version}",
            extra={"trigger": trigger, "previous_version": old},
        ))
        return {"ok": True, "version": new.version, "previous": old}

    def vault_status(self, state: str, cause: str) -> None:
        """VaultClient's on_status hook: a gauge and a `vault_status` event per transition."""
        self.metrics.vault_up.set(1 if state == "up" else 0)
        self.events.write(make_event(
            component="broker", action="vault_status",
            reason="vault_up" if state == "up" else Reason.VAULT_UNAVAILABLE,
            message=f"vault {state}" + (f" ({cause})" if cause else ""),
        ))

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rules_version": self.rules.version}
        st = getattr(self.secrets, "status", None)
        if callable(st):
            out.update(st())
        return out

    # -- the two call styles -------------------------------------------------------------
    async def handle(self, request: BaseRequest) -> web.StreamResponse:
        """Every request: `POST /v1/call`, anything else is pass-through. Routed here by
        hand because aiohttp's router, Application and middleware wrapper cost more per
        call than this one comparison (the API name is parsed in `_parse_passthrough`)."""
        expect = request.headers.get("Expect")
        if expect and request.version == HttpVersion11:
            # what aiohttp's router did: let a client waiting to send its body go on
            if expect.lower() != "100-continue":
                return self._refuse_expect(request)
            defer_continue(request)  # sent once the body's limits are checked
        if request.method == "POST" and request.path == "/v1/call":
            return await self.handle_call(request)
        return await self.handle_passthrough(request)

    def _refuse_expect(self, request: BaseRequest) -> web.Response:
        cl = CallLog(self.clock(), request.remote or "")
        cl.task = self.registry.by_address(cl.source_ip)
        resp = self._deny(cl, Denied(417, Reason.BAD_REQUEST, "unsupported Expect value"))
        self._audit_soon(cl)
        return resp

    async def handle_call(self, request: BaseRequest) -> web.StreamResponse:
        """`POST /v1/call` {api, method, path, query, headers, body | json}."""
        cl = CallLog(self.clock(), request.remote or "")
        slot: str | None = None
        res: Reservation | None = None
        try:
            task, profile = self._identify(cl)
            slot = self._take_slot(task)
            res = Reservation(self.bodies, task.task_id)
            limit = call_doc_limit(profile.broker.values(), self.settings.max_request_bytes)
            raw = await self._read_body(request, limit, res)
            try:
                doc = json.loads(raw)
            except (ValueError, RecursionError):  # JSON/UTF-8 errors, absurd nesting
                raise Denied(400, Reason.BAD_REQUEST, "body must be a JSON object") from None
            call = self._parse_call_doc(doc, profile)
            cl.api, cl.method, cl.path = call.api, call.method, call.match_path
            api, grant = self._authorize(cl, profile, call)
            result = await self._forward(cl, task, api, grant, call, None)
            return web.json_response(result, status=200)
        except Denied as d:
            return await self._deny_request(request, cl, d)
        except Exception as e:
            return self._internal(cl, e)
        finally:
            if slot is not None:
                self.inflight.release(slot)
            if res is not None:
                res.release()
            self._audit_soon(cl)

    async def handle_passthrough(self, request: BaseRequest) -> web.StreamResponse:
        """`/{api}/{path...}`: an unmodified SDK with its base URL pointed at the broker."""
        cl = CallLog(self.clock(), request.remote or "")
        slot: str | None = None
        res: Reservation | None = None
        try:
            task, profile = self._identify(cl)
            slot = self._take_slot(task)
            call = self._parse_passthrough(request)
            cl.api, cl.method, cl.path = call.api, call.method, call.match_path
            api, grant = self._authorize(cl, profile, call)
            raw = b""
            if request.can_read_body:  # no deadline (timer) to arm for a bodiless GET
                res = Reservation(self.bodies, task.task_id)
                raw = await self._read_body(request, grant.max_body_bytes, res)
            if raw:
                call = CallRequest(call.api, call.method, call.path, call.match_path,
                                   call.query, call.headers, raw)
            await self._forward(cl, task, api, grant, call, request)
            assert cl.response is not None  # _forward streamed the answer into it
            return cl.response
        except Denied as d:
            return await self._deny_request(request, cl, d)
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the caller went away
        except Exception as e:
            if cl.response is not None and cl.response.prepared:
                # mid-stream: cut the connection; log the class only, never the message
                log.error("internal error mid-stream: %s", type(e).__name__)
                cl.extra["error"] = type(e).__name__
                cl.decision, cl.reason = "denied", INTERNAL_ERROR
                if request.transport is not None:
                    request.transport.abort()
                return cl.response
            return self._internal(cl, e)
        finally:
            if slot is not None:
                self.inflight.release(slot)
            if res is not None:
                res.release()
            self._audit_soon(cl)

    async def _deny_request(self, request: BaseRequest, cl: CallLog, d: Denied) -> web.Response:
        """`_deny`, and for a body that timed out also close the connection right after
        the answer: the rest of that body is not worth aiohttp's lingering read (it would
        keep reading a trickling client for `lingering_time` more)."""
        resp = self._deny(cl, d)
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

    async def _read_body(self, request: BaseRequest, limit: int, res: Reservation) -> bytes:
        """The body within `limit` and the task's body budget (broker/body.py)."""
        try:
            return await read_within(request, limit, res,
                                          self.settings.request_body_timeout_s)
        except TimeoutError:  # a BodyLimit is a Denied already
            raise Denied(408, Reason.REQUEST_TIMEOUT, BODY_TIMEOUT_MESSAGE) from None

    # -- steps ---------------------------------------------------------------------------
    def _take_slot(self, task: Task) -> str:
        """One of the task's `max_concurrent_calls_per_task` slots, held until the call's
        handler returns (body read, Vault, upstream, streamed answer)."""
        if not self.inflight.acquire(task.task_id):
            raise Denied(429, Reason.CONCURRENCY_LIMIT,
                         "too many calls of this task in flight", retry_after=1)
        return task.task_id

    def _identify(self, cl: CallLog) -> tuple[Task, Profile]:
        task = self.registry.by_address(cl.source_ip)
        if task is None:
            raise Denied(403, Reason.UNKNOWN_TASK, "caller address is not a registered task")
        cl.task = task
        profile = self.rules.profiles.get(task.profile)
        if profile is None:
            raise Denied(403, Reason.UNKNOWN_PROFILE, "the task's profile is not loaded")
        return task, profile

    def _parse_passthrough(self, request: BaseRequest) -> CallRequest:
        items = list(request.headers.items())
        if inflated(request):  # the body goes upstream as read: decoded
            items = [(k, v) for k, v in items if k.lower() != "content-encoding"]
        try:
            return parse_passthrough(request.raw_path, request.method, items, self.rules.apis)
        except RequestError as e:
            raise Denied(400, Reason.BAD_REQUEST, str(e)) from None

    def _parse_call_doc(self, doc: Any, profile: Profile) -> CallRequest:
        try:
            return parse_call_doc(doc, self.rules.apis)
        except RequestError as e:
            raise Denied(400, Reason.BAD_REQUEST, str(e)) from None

    def _authorize(
        self, cl: CallLog, profile: Profile, call: CallRequest
    ) -> tuple[ApiDefinition, BrokerGrant]:
        grant = profile.broker.get(call.api)
        api = self.rules.apis.get(call.api)
        if grant is None or api is None:
            raise Denied(403, Reason.API_NOT_ALLOWED, "the task's profile does not grant this API")
        if not self._operation_allowed(grant, call.method, call.path):
            raise Denied(403, Reason.OPERATION_NOT_ALLOWED,
                         "the task's profile does not grant this method and path")
        if len(call.body) > grant.max_body_bytes:
            raise Denied(413, Reason.BODY_TOO_LARGE, "request body too large")
        return api, grant

    def _operation_allowed(self, grant: BrokerGrant, method: str, path: str) -> bool:
        from stockade.policy import match_operation

        key = (id(grant), method, path)
        hit = self._op_cache.get(key)
        if hit is not None and hit[0] is grant:  # same object, not a recycled id
            self._op_cache.move_to_end(key)
            return hit[1]
        ok = match_operation(grant, method, path)
        self._op_cache[key] = (grant, ok)
        if len(self._op_cache) > 1024:
            self._op_cache.popitem(last=False)
        return ok

    def _route(self, api: ApiDefinition) -> ApiRoute:
        r = self._routes.get(api.name)
        if r is None or r.api is not api:
            try:
                up: Upstream | None = parse_base_url(api)
            except RequestError:
                up = None
            category = self._literal_forbidden(up.host) if up is not None else None
            r = ApiRoute(api, up, category, self.metrics.api(api.name))
            self._routes[api.name] = r
        return r

    def _literal_forbidden(self, host: str) -> str | None:
        if self._address_policy is None or host in self.settings.hosts:
            return None
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return None  # a name: the checked resolver decides
        return self._address_policy.check(ip)

    def _credential(self, api: ApiDefinition, sv: SecretValue) -> Credential:
        # keyed by the injection too: a reload may change the template or user name,
        # and with it the rendered values that must be scrubbed
        key = (api.name, api.injection, sv.value, sv.version)
        c = self._credentials.get(key)
        if c is None:
            try:
                inj = inject(api.injection, sv.value)
                query = encode_query(inj.query)
            except RequestError:
                raise Denied(503, Reason.VAULT_UNAVAILABLE, "credential unusable") from None
            c = Credential((*inj.headers, ("Accept-Encoding", "identity")), query,
                           Patterns.build((sv.value, *inj.rendered_values)))
            self._credentials[key] = c
            while len(self._credentials) > 256:
                self._credentials.popitem(last=False)
        else:
            self._credentials.move_to_end(key)
        return c

    async def _forward(
        self,
        cl: CallLog,
        task: Task,
        api: ApiDefinition,
        grant: BrokerGrant,
        call: CallRequest,
        passthrough: BaseRequest | None,
    ) -> dict[str, Any]:
        now = self.clock()
        bucket = self.limiter.bucket(task.task_id, api.name, grant.rate_per_second, grant.burst)
        wait = bucket.take(now)
        if wait > 0:
            raise Denied(429, Reason.RATE_LIMITED, "rate limit for this API exceeded", wait)
        budget = self.limiter.budget(task.task_id, api.name, grant.budget_calls, grant.budget_bytes)
        if budget.exhausted():
            raise Denied(403, Reason.BUDGET_EXHAUSTED, "the task's budget for this API is spent")
        route = self._route(api)
        up = route.upstream
        if up is None:
            raise Denied(502, UPSTREAM_ERROR, "API definition unusable")
        cl.upstream = up
        if route.address_category is not None:
            cl.extra["address_category"] = route.address_category
            raise Denied(502, Reason.UPSTREAM_UNREACHABLE, "upstream address refused")
        try:
            sv = self._fresh(api.credential) if self._fresh is not None else None
            if sv is None:
                sv = await self.secrets.get(api.credential)
        except VaultUnavailable:
            raise Denied(503, Reason.VAULT_UNAVAILABLE, "credential store unavailable") from None
        cred = self._credential(api, sv)
        patterns = cred.patterns
        query = strip_injected_query(call.query, api.injection) + cred.query
        url = build_url(up, call.path, query)
        headers = [*call.headers, *cred.headers]
        budget.charge_call()
        budget.charge_bytes(len(call.body))
        cl.bytes_up = len(call.body)
        m = route.metrics
        if call.body:
            m.bytes_up.inc(len(call.body))
        assert self._session is not None
        t_up = time.perf_counter()
        cut = False  # a streamed answer was cut after its headers were sent
        result: dict[str, Any] = {}
        left = budget.bytes_left()
        cap = self.settings.max_call_response_bytes if passthrough is None else None
        try:
            async with self._session.request(
                call.method, url, headers=headers, data=call.body or None,
                allow_redirects=False,
            ) as resp:
                cl.status = resp.status
                try:
                    decoder = BodyDecoder(resp.headers.get("Content-Encoding"),
                                          self.settings.max_decoded_bytes)
                except EncodingRefused:
                    raise Denied(502, UPSTREAM_ERROR, "upstream used an unsupported "
                                 "content coding") from None
                out_headers, n_h = self._scrub_headers(resp.headers.items(), patterns)
                if passthrough is not None and any(
                        n.lower() in LINK_HEADERS for n, _ in out_headers):
                    prefix = f"{passthrough.scheme}://{passthrough.host}/{api.name}"
                    out_headers = rewrite_links(out_headers, api.base_url, prefix)
                scrubber = StreamScrubber(patterns)
                small = (resp.content_length is not None
                         and resp.content_length <= SMALL_BODY
                         and decoder.coding == "identity")
                if passthrough is not None and not small:
                    await self._stream_back(cl, passthrough, resp, out_headers, decoder,
                                            scrubber, left, budget)
                else:
                    try:
                        body = await self._read_all(resp, decoder, scrubber, cap, left, small)
                    except Denied as d:
                        if d.reason == Reason.BUDGET_EXHAUSTED:
                            budget.exhaust()
                        raise
                    if passthrough is not None:
                        # small known-length answer: one buffered response, no chunking
                        cl.response = web.Response(status=resp.status, reason=resp.reason,
                                                   body=body, headers=out_headers)
                    else:
                        result = self._call_result(resp.status, out_headers, body)
                    budget.charge_bytes(len(body))
                    cl.bytes_down = len(body)
                cl.scrubs = n_h + scrubber.count
        except Denied:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError, EncodingRefused, DecodeLimit) as e:
            cl.extra["error"] = type(e).__name__
            if passthrough is not None and cl.response is not None:
                # headers are already sent: cut the connection so the caller sees a
                # truncated body, never one that looks complete
                cut_budget = cl.extra.get("cut") == "budget"
                cl.decision = "denied"
                cl.reason = Reason.BUDGET_EXHAUSTED if cut_budget else UPSTREAM_ERROR
                if passthrough.transport is not None:
                    passthrough.transport.abort()
                cut = True
            elif isinstance(e, TimeoutError | asyncio.TimeoutError):
                raise Denied(504, Reason.UPSTREAM_UNREACHABLE, "upstream timed out") from None
            else:
                raise Denied(502, Reason.UPSTREAM_UNREACHABLE, "upstream call failed") from None
        finally:
            # observed by `_audit`, after the answer went out (bytes_down is final then)
            cl.upstream_s = time.perf_counter() - t_up
            cl.metrics = m
        if cl.scrubs:
            self._secret_echo(cl, api.name, m)
        if not cut:
            cl.decision, cl.reason = "allowed", Reason.ALLOWED_BY_RULE
        return result

    @staticmethod
    def _scrub_headers(items: Any, patterns: Patterns) -> tuple[list[tuple[str, str]], int]:
        kept = filter_response_headers(items)
        values, n = patterns.scrub_texts([v for _, v in kept])
        if not n:
            return kept, 0
        return [(name, v) for (name, _), v in zip(kept, values, strict=True)], n

    async def _read_all(
        self,
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
                self._check_size(size, limit, cap)
                parts.append(data)
        tail = scrubber.feed(decoder.flush()) + scrubber.flush()
        parts.append(tail)
        self._check_size(size + len(tail), limit, cap)
        return b"".join(parts)

    @staticmethod
    def _check_size(size: int, limit: int | None, cap: int | None) -> None:
        if limit is not None and size > limit:
            if cap is not None and size > cap:
                raise Denied(502, UPSTREAM_ERROR, "upstream response too large")
            raise Denied(403, Reason.BUDGET_EXHAUSTED,
                         "the task's byte budget for this API is spent")

    @staticmethod
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

    async def _stream_back(
        self,
        cl: CallLog,
        request: BaseRequest,
        resp: aiohttp.ClientResponse,
        headers: list[tuple[str, str]],
        decoder: BodyDecoder,
        scrubber: StreamScrubber,
        budget_left: int | None,
        budget: Any,
    ) -> None:
        out = web.StreamResponse(status=resp.status, reason=resp.reason)
        for n, v in headers:
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

    def _internal(self, cl: CallLog, e: Exception) -> web.Response:
        """A bug, not a decision: fail closed with a fixed text. Only the exception's class
        is logged — messages (e.g. a URL carrying a query-injected key) never are."""
        log.error("internal error handling a call: %s", type(e).__name__)
        cl.extra["error"] = type(e).__name__
        return self._deny(cl, Denied(500, INTERNAL_ERROR, "internal error"))

    # -- denials, events ----------------------------------------------------------------
    def _deny(self, cl: CallLog, d: Denied) -> web.Response:
        cl.decision, cl.reason, cl.status = "denied", d.reason, d.status
        headers = {"X-Stockade-Deny": str(d.reason)}
        if d.retry_after > 0:
            headers["Retry-After"] = str(max(1, int(d.retry_after + 0.999)))
        return web.json_response(
            {"error": "denied", "reason": str(d.reason), "message": d.message},
            status=d.status, headers=headers,
        )

    def _audit(self, cl: CallLog) -> None:
        api = cl.api if cl.api and cl.api in self.rules.apis else None
        self.metrics.call(api or "-", str(cl.reason))
        if cl.metrics is not None and cl.upstream_s is not None:
            cl.metrics.upstream_seconds.observe(cl.upstream_s)
            cl.metrics.bytes_down.inc(cl.bytes_down)
        latency_ms = (self.clock() - cl.t0) * 1000.0
        extra: dict[str, Any] = {
            "api": cl.api if api else None,
            "status": cl.status,
            "bytes_up": cl.bytes_up,
            "bytes_down": cl.bytes_down,
            "latency_ms": round(latency_ms, 3),
            **cl.extra,
        }
        up = cl.upstream
        self.events.write(make_event(
            component="broker", action="broker_call", decision=cl.decision,  # type: ignore[arg-type]
            reason=str(cl.reason),
            task_id=cl.task.task_id if cl.task else None,
            profile=cl.task.profile if cl.task else None,
            policy_version=self.rules.version,
            source_ip=cl.source_ip or None,
            destination_domain=up.host if up else None,
            destination_port=up.port if up else None,
            transport="tcp", protocol="http",
            http_method=cl.method, http_status=cl.status,
            url={"path": cl.path[:2048]} if cl.path else None,
            extra={k: v for k, v in extra.items() if v is not None},
        ))

    def _secret_echo(self, cl: CallLog, api: str, m: ApiMetrics) -> None:
        m.scrubs.inc(cl.scrubs)
        self.events.write(make_event(
            component="broker", action="secret_echo", decision=None,
            reason=Reason.SECRET_ECHO,
            task_id=cl.task.task_id if cl.task else None,
            profile=cl.task.profile if cl.task else None,
            policy_version=self.rules.version,
            source_ip=cl.source_ip or None,
            destination_domain=cl.upstream.host if cl.upstream else None,
            http_method=cl.method, http_status=cl.status,
            url={"path": cl.path[:2048]} if cl.path else None,
            message="upstream response echoed the credential; removed before the caller saw it",
            extra={"api": api, "scrubs": cl.scrubs},
        ))



async def _no_expect(_request: web.Request) -> None:
    """`Broker.app()`'s route: `Broker.handle` answers Expect itself."""
