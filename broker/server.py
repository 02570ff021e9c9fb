"""The broker's asyncio shell: routes each request through its steps (`request` parses,
`routes` admits and authorizes, `forward` calls the upstream, `audit` writes the one
`broker_call` event every call ends in) and keeps the per-task state. Denials are JSON
`{"error": "denied", "reason": <code>, "message": ...}` plus an `X-Stockade-Deny` header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.http import HttpVersion11
from aiohttp.web_request import BaseRequest
from stockade.policy.model import Profile
from stockade.policy.reasons import Reason

from stockade.events import EventWriter
from stockade.tasks import TaskRegistry

from .audit import Auditor, CallLog, Rules
from .body import BodyBudget, Reservation, call_doc_limit, defer_continue, inflated
from .credentials import CredentialCache, SecretSource
from .denials import Denied, bad_request, deny_response
from .forward import Forwarder, open_session
from .httpserver import GuardedRunner, HeadLimits
from .limits import InFlight, Limiter
from .metrics import BrokerMetrics
from .request import CallRequest, parse_call_doc, parse_passthrough
from .routes import AddressCheck, Admission, OperationCache, RouteTable, admit_caller, authorize
from .settings import BrokerSettings
from .stream import deny_request, fail_request, read_body

__all__ = ["Broker", "Denied"]  # Denied: callers and tests import it from here too

log = logging.getLogger("stockade.broker")

Step = Callable[[BaseRequest, CallLog, Admission], Awaitable[web.StreamResponse]]


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
        self.registry = registry
        self.events = events
        self.metrics = metrics or BrokerMetrics()
        self._load_rules = load_rules
        self.clock = clock
        self._resolver = resolver
        self.limiter = Limiter()
        self.inflight = InFlight(settings.max_concurrent_calls_per_task)
        self.bodies = BodyBudget(settings.max_body_bytes_in_flight_per_task)
        self.credentials = CredentialCache(secrets)
        self.routes = RouteTable(self.metrics, address_policy, settings.hosts)
        self.operations = OperationCache()
        self.auditor = Auditor(events, self.metrics, registry, clock, lambda: self.rules)
        self.forwarder = Forwarder(settings, self.limiter, self.routes, self.credentials,
                                   self.auditor, clock)
        registry.on_removed(lambda t: self.limiter.forget(t.task_id))
        self.metrics.track_dropped(lambda: events.dropped)

    @property
    def secrets(self) -> SecretSource:
        """Where credentials come from; replaceable while serving (the cache keeps it)."""
        return self.credentials.secrets

    @secrets.setter
    def secrets(self, source: SecretSource) -> None:
        self.credentials.secrets = source

    async def start(self) -> None:
        if self.forwarder.session is None:
            self.forwarder.session = open_session(self.settings, self._resolver)

    async def close(self) -> None:
        self.auditor.loop = None
        if self.forwarder.session is not None:
            await self.forwarder.session.close()
            self.forwarder.session = None

    def app(self) -> web.Application:
        """`handle` as an aiohttp Application (for embedding next to other routes); the
        broker itself serves `runner()`, which skips the Application layer."""
        app = web.Application(client_max_size=self.settings.max_request_bytes)
        # `handle` answers Expect itself (the router's default handler would too)
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=_no_expect)
        app.on_startup.append(lambda _app: self.start())
        app.on_cleanup.append(lambda _app: self.close())
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
        return GuardedRunner(self.handle, guard=self.auditor, limits=limits,
                             client_max_size=s.max_request_bytes,
                             on_startup=self.start, on_cleanup=self.close,
                             keepalive_timeout=s.keepalive_timeout_s, **kwargs)

    async def reload(self, trigger: str = "control") -> dict[str, Any]:
        """SIGHUP and the control API: load and swap the rules; on any problem keep the old
        ones (same event fields and reasons as the gateway's: `rules_loaded` / `rules_invalid`)."""
        if self._load_rules is None:
            return {"ok": False, "error": "no rule source"}
        old = self.rules.version
        try:
            new = await asyncio.get_running_loop().run_in_executor(None, self._load_rules)
        except Exception as e:  # RulesError and friends: keep serving with the old rules
            problems = [str(p) for p in getattr(e, "problems", [])][:20] or [
                type(e).__name__]
            self.auditor.reload_refused(old, trigger, problems)
            log.warning("rule reload (%s) refused, keeping version %s", trigger, old)
            return {"ok": False, "version": old, "problems": problems}
        self.rules = new  # one reference swap: a call sees the old or the new rules
        # stale entries would be rebuilt or missed anyway (keyed by object); clearing
        # lets the old rule objects go
        self.routes.clear()
        self.operations.clear()
        self.auditor.reloaded(old, new.version, trigger)
        return {"ok": True, "version": new.version, "previous": old}

    def vault_status(self, state: str, cause: str) -> None:
        """VaultClient's on_status hook: a gauge and a `vault_status` event per transition."""
        self.auditor.vault_status(state, cause)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rules_version": self.rules.version}
        st = getattr(self.secrets, "status", None)
        if callable(st):
            out.update(st())
        return out

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
        resp = deny_response(cl, Denied(417, Reason.BAD_REQUEST, "unsupported Expect value"))
        self.auditor.soon(cl)
        return resp

    async def handle_call(self, request: BaseRequest) -> web.StreamResponse:
        """`POST /v1/call` {api, method, path, query, headers, body | json}."""
        return await self._serve(request, self._call, streams=False)

    async def handle_passthrough(self, request: BaseRequest) -> web.StreamResponse:
        """`/{api}/{path...}`: an unmodified SDK with its base URL pointed at the broker."""
        return await self._serve(request, self._passthrough, streams=True)

    async def _serve(self, request: BaseRequest, step: Step, *,
                     streams: bool) -> web.StreamResponse:
        """Both styles: identify the caller and hold a slot, run `step`, turn a refusal or
        a bug into the JSON denial, release what the call held, audit it."""
        cl = CallLog(self.clock(), request.remote or "")
        adm: Admission | None = None
        try:
            adm = admit_caller(cl, self.registry, self.rules.profiles, self.inflight)
            return await step(request, cl, adm)
        except Denied as d:
            return await deny_request(request, cl, d)
        except Exception as e:
            if streams and isinstance(e, ConnectionResetError):
                raise  # the caller went away
            return fail_request(request, cl, e)
        finally:
            if adm is not None:
                adm.release()
            self.auditor.soon(cl)

    async def _call(self, request: BaseRequest, cl: CallLog, adm: Admission) -> web.Response:
        adm.res = Reservation(self.bodies, adm.task.task_id)
        limit = call_doc_limit(adm.profile.broker.values(), self.settings.max_request_bytes)
        raw = await read_body(request, limit, adm.res, self.settings.request_body_timeout_s)
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):  # JSON/UTF-8 errors, absurd nesting
            raise Denied(400, Reason.BAD_REQUEST, "body must be a JSON object") from None
        call = self._parse_call_doc(doc, adm.profile)
        cl.api, cl.method, cl.path = call.api, call.method, call.match_path
        api, grant = authorize(self.rules.apis, adm.profile, call, self.operations)
        result = await self.forwarder.forward(cl, adm.task, api, grant, call, None)
        return web.json_response(result, status=200)

    async def _passthrough(self, request: BaseRequest, cl: CallLog,
                           adm: Admission) -> web.StreamResponse:
        call = self._parse_passthrough(request)
        cl.api, cl.method, cl.path = call.api, call.method, call.match_path
        api, grant = authorize(self.rules.apis, adm.profile, call, self.operations)
        if request.can_read_body:  # no deadline (timer) to arm for a bodiless GET
            adm.res = Reservation(self.bodies, adm.task.task_id)
            raw = await read_body(request, grant.max_body_bytes, adm.res,
                                  self.settings.request_body_timeout_s)
            if raw:
                call = CallRequest(call.api, call.method, call.path, call.match_path,
                                   call.query, call.headers, raw)
        await self.forwarder.forward(cl, adm.task, api, grant, call, request)
        assert cl.response is not None  # forward streamed the answer into it
        return cl.response

    def _parse_passthrough(self, request: BaseRequest) -> CallRequest:
        items = list(request.headers.items())
        if inflated(request):  # the body goes upstream as read: decoded
            items = [(k, v) for k, v in items if k.lower() != "content-encoding"]
        with bad_request():
            return parse_passthrough(request.raw_path, request.method, items, self.rules.apis)

    def _parse_call_doc(self, doc: Any, profile: Profile) -> CallRequest:
        with bad_request():
            return parse_call_doc(doc, self.rules.apis)


async def _no_expect(_request: web.Request) -> None:
    """`Broker.app()`'s route: `Broker.handle` answers Expect itself."""
