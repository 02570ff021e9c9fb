"""The mitmproxy internals the inspector replaces, and the layer/TLS classes it adds.

mitmproxy has no hook for any of these, so each is a wrapper around one private method
or module attribute. They are named in PATCHES with the mitmproxy version they were
checked against; a unit test compares that with the installed mitmproxy, so an upgrade
past it (pyproject pins `<11.1`) fails a test before it can silently change what the
sandbox sees. The patches are process-wide, so their mutable state is one PatchState
(`STATE`), installed once by the inspector child before its master starts.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from stockade.policy.reasons import Reason

from .requests import denial_body

if TYPE_CHECKING:
    from .addon import StockadeAddon

log = logging.getLogger("stockade.gateway.inspector")

# flow.metadata key: this request was denied at its headers (its body is never read)
DENIED_EARLY = "stockade_denied_early"
CHECKED_AGAINST = "11.0.x"


@dataclass
class PatchState:
    """What the patched methods need from the running inspector."""

    installed: bool = False
    head_conn: Any = None  # the client connection whose HTTP/1 head is being read
    addon: StockadeAddon | None = None  # for the refusals' events
    refuse: type | None = None  # the Refuse layer class, built on first use

    def refused(self, conn: Any, detail: str) -> None:
        """An event for a protocol refusal on the sandbox's connection `conn` (none when
        it is not a handed-over flow: there is no task to name)."""
        addon = self.addon
        if conn is None or addon is None:
            return
        meta = addon.flows.get(conn.id)
        if meta is not None:
            addon._flow_event(meta, Reason.PROTOCOL_UNRECOGNISED, detail)


STATE = PatchState()


def _patch_early_denial(state: PatchState) -> None:
    """mitmproxy answers a response set in `requestheaders` only after it has read (and
    buffered) the whole request body: a denied upload of any size would sit in the
    inspector's memory. This wraps HttpStream's header state so that, for a request the
    addon denied (DENIED_EARLY) whose body is still to come, the 403 goes out at once, the
    stream is reset (HTTP/2 RST_STREAM; HTTP/1 closes the connection) and whatever body
    arrives later is dropped unread."""
    from mitmproxy.http import status_codes
    from mitmproxy.proxy.layers.http import HttpStream, ResponseEndOfMessage, SendHttp
    from mitmproxy.proxy.layers.http._events import ResponseProtocolError

    orig = HttpStream.state_wait_for_request_headers

    def state_wait_for_request_headers(self: Any, event: Any) -> Any:
        yield from orig(self, event)
        f = getattr(self, "flow", None)
        if (
            f is None
            or f.response is None
            or not f.metadata.get(DENIED_EARLY)
            or getattr(event, "end_stream", True)
            or self.client_state != self.state_consume_request_body
        ):
            return
        self.client_state = self.state_errored  # the body: dropped unread
        yield from self.send_response()
        self.server_state = self.state_errored
        if f.request.is_http2:
            # HTTP/2: end the response, then reset the stream (the client stops sending).
            # HTTP/1: no end-of-message (the connection would start reading the next
            # request); the error below closes the connection after the response.
            yield SendHttp(ResponseEndOfMessage(self.stream_id), self.context.client)
        yield SendHttp(
            ResponseProtocolError(self.stream_id, "denied", status_codes.NO_RESPONSE),
            self.context.client,
        )
        f.live = False

    state_wait_for_request_headers.__name__ = orig.__name__
    HttpStream.state_wait_for_request_headers = state_wait_for_request_headers  # type: ignore[method-assign]


def _stockade_error_response(state: PatchState, status_code: int, message: str = "") -> bytes:
    """mitmproxy's HTTP/1 error page (an HTML page with `Server: mitmproxy <version>` and
    its parser's message) replaced by Stockade's small JSON body; the message goes to the
    inspector's log only."""
    from mitmproxy import http
    from mitmproxy.net.http import http1

    log.info("inspector: client protocol error %s: %s", status_code, message)
    # an HTTP/1 head mitmproxy could not parse: there is no flow (so no requestheaders
    # event); the denial is logged for the sandbox's connection
    state.refused(state.head_conn, f"unparseable HTTP/1 request head: {message}"[:200])
    resp = http.Response.make(
        status_code,
        denial_body(str(Reason.PROTOCOL_UNRECOGNISED), None, None),
        {
            "Connection": "close",
            "Content-Type": "application/json",
            "X-Stockade-Deny": str(Reason.PROTOCOL_UNRECOGNISED),
        },
    )
    return http1.assemble_response(resp)


def _patch_http1_error_page(state: PatchState) -> None:
    from mitmproxy.proxy.layers.http import _http1

    _http1.make_error_response = functools.partial(_stockade_error_response, state)


def _patch_http1_head_conn(state: PatchState) -> None:
    """The client connection published for _stockade_error_response, which mitmproxy
    calls without it (no flow exists yet for a head it cannot parse)."""
    from mitmproxy.proxy.layers.http import _http1

    read_headers = _http1.Http1Server.read_headers

    def read_headers_of(self: Any, event: Any) -> Any:
        def publish(on: bool) -> None:
            state.head_conn = self.conn if on else None

        return (yield from _stepped(read_headers(self, event), publish))

    _http1.Http1Server.read_headers = read_headers_of  # type: ignore[method-assign]


def _patch_http2_error_body(state: PatchState) -> None:
    from mitmproxy.proxy.layers.http import _http2

    _http2.format_error = lambda code, message: denial_body(  # type: ignore[assignment]
        str(Reason.PROTOCOL_UNRECOGNISED), None, None
    )


def _patch_http2_server_name(state: PatchState) -> None:
    from mitmproxy.proxy.layers.http import _http2

    _http2.version = types.SimpleNamespace(MITMPROXY="stockade")  # type: ignore[assignment]


def _patch_http2_goaway(state: PatchState) -> None:
    """An HTTP/2 GOAWAY carries no debug text (mitmproxy puts its message there)."""
    import h2.errors
    from mitmproxy.proxy.commands import Log, SendData
    from mitmproxy.proxy.layers.http import _http2

    def protocol_error(
        self: Any, message: str, error_code: int = h2.errors.ErrorCodes.PROTOCOL_ERROR
    ) -> Any:
        yield Log(f"inspector: HTTP/2 protocol error: {message}")
        if self.conn is self.context.client:  # the sandbox's side
            state.refused(self.conn, "HTTP/2 protocol error (GOAWAY)")
        self.h2_conn.close_connection(error_code)  # no additional_data: no message
        yield SendData(self.conn, self.h2_conn.data_to_send())
        yield from self.close_connection(message)

    _http2.Http2Connection.protocol_error = protocol_error  # type: ignore[method-assign]


def _patch_http2_error_headers(state: PatchState) -> None:
    """An error stream: mitmproxy's headers (text/html, its name) swapped for ours while
    it sends them (the body is format_error's, above)."""
    from mitmproxy.proxy.layers.http import ResponseProtocolError, _http2

    handle_event = _http2.Http2Connection._handle_event

    def handle_event_of(self: Any, event: Any) -> Any:
        if not isinstance(event, ResponseProtocolError):
            return (yield from handle_event(self, event))
        h2c = self.h2_conn

        def swap(on: bool) -> None:
            if on:
                h2c.send_headers = functools.partial(_json_error_headers, h2c)
            else:
                h2c.__dict__.pop("send_headers", None)

        return (yield from _stepped(handle_event(self, event), swap))

    _http2.Http2Connection._handle_event = handle_event_of  # type: ignore[method-assign]


def _stepped(gen: Any, around: Callable[[bool], None]) -> Any:
    """Run a mitmproxy command generator with `around(True)` before and `around(False)`
    after each of its steps (state that must hold only while its own code runs)."""
    sent: Any = None
    while True:
        around(True)
        try:
            cmd = gen.send(sent)
        except StopIteration as stop:
            return stop.value
        finally:
            around(False)
        sent = yield cmd


def _json_error_headers(h2c: Any, stream_id: int, headers: list[Any], **kw: Any) -> Any:
    """HTTP/2 error-stream headers as Stockade's denials carry them."""
    status = [(k, v) for k, v in headers if k == b":status"]
    ours = [
        (b"server", b"stockade"),
        (b"content-type", b"application/json"),
        (b"x-stockade-deny", str(Reason.PROTOCOL_UNRECOGNISED).encode()),
    ]
    return type(h2c).send_headers(h2c, stream_id, status + ours, **kw)


def _no_check(_self: Any) -> None:
    return None


def _patch_message_typecheck(state: PatchState) -> None:
    """mitmproxy type-checks every field of every request and response it builds while
    `__debug__` is on (any Python run without -O): a check of its own constructors'
    output, not of the sandbox's bytes (the parser built the values), and ~8% of the
    inspector's CPU per request in a py-spy profile (bench/README.md "Inspected path").
    Python's -O would drop it too, but also every assert of ours."""
    from mitmproxy import http

    http.MessageData.__post_init__ = _no_check  # type: ignore[method-assign]


_SHARED_AS_IS = (type(None), bool, int, float, str, bytes)


def _patch_option_copies(state: PatchState) -> None:
    """Every read of a mitmproxy option (several per request: `proxy_debug` per layer,
    `body_size_limit` per message) deep-copies its value. For an immutable value the copy
    is the value itself, so it is returned without the copy machinery; anything else is
    still copied."""
    from mitmproxy import optmanager

    original = optmanager._Option.current

    @functools.wraps(original)
    def current(self: Any) -> Any:
        value = self._default if self.value is optmanager.unset else self.value
        if type(value) in _SHARED_AS_IS:
            return value
        return original(self)

    optmanager._Option.current = current  # type: ignore[method-assign]


_HOOKED = "_stockade_hooked"  # AddonManager attribute: hook name -> addons implementing it


def _patch_hook_dispatch(state: PatchState) -> None:
    """mitmproxy dispatches every hook (several per request, and an `update` hook after
    each of a flow's) by walking every addon and its children with getattr (~7% of the
    inspector's CPU per request). Which top-level addons implement a hook is kept per
    hook name until the chain changes (add, remove, clear); the handlers still run in
    chain order, each top-level addon in its own safecall, and AddonHalt still stops the
    rest. (The inspector's addons have no children that come and go.)"""
    from mitmproxy import addonmanager, exceptions

    mgr = addonmanager.AddonManager

    def hooked(self: Any, event: Any) -> list[Any]:
        cache = self.__dict__.setdefault(_HOOKED, {})
        chain = cache.get(event.name)
        if chain is None:
            chain = [a for a in self.chain if next(self._iter_hooks(a, event), None)]
            cache[event.name] = chain
        return chain

    async def trigger_event(self: Any, event: Any) -> None:
        try:
            chain = hooked(self, event)
        except exceptions.AddonManagerError:  # a non-callable handler: as mitmproxy does
            chain = self.chain
        for addon in chain:
            try:
                with addonmanager.safecall():
                    await self.invoke_addon(addon, event)
            except exceptions.AddonHalt:
                return

    def forgetting(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.__dict__.pop(_HOOKED, None)
            try:
                return method(self, *args, **kwargs)
            finally:
                self.__dict__.pop(_HOOKED, None)

        return wrapper

    functools.update_wrapper(trigger_event, mgr.trigger_event)
    mgr.trigger_event = trigger_event  # type: ignore[method-assign]
    for name in ("add", "remove", "clear"):
        setattr(mgr, name, forgetting(getattr(mgr, name)))


class Patch(NamedTuple):
    target: str  # "module:attribute.path" the patch replaces
    why: str
    checked: str  # the mitmproxy version whose code the wrapper was checked against
    install: Callable[[PatchState], None]


_HTTP = "mitmproxy.proxy.layers.http"
# installed in this order. No mitmproxy error page, version or parser message ever
# reaches the sandbox: HTTP/1 error responses and HTTP/2 error streams carry Stockade's
# JSON body with `Server: stockade`, and an HTTP/2 GOAWAY carries no debug text.
PATCHES: tuple[Patch, ...] = (
    Patch(
        f"{_HTTP}:HttpStream.state_wait_for_request_headers",
        "a denied request's 403 goes out before its body is read",
        CHECKED_AGAINST,
        _patch_early_denial,
    ),
    Patch(
        f"{_HTTP}._http1:make_error_response",
        "HTTP/1 error pages: Stockade's JSON body",
        CHECKED_AGAINST,
        _patch_http1_error_page,
    ),
    Patch(
        f"{_HTTP}._http1:Http1Server.read_headers",
        "the connection whose unparseable head is refused, for its event",
        CHECKED_AGAINST,
        _patch_http1_head_conn,
    ),
    Patch(
        f"{_HTTP}._http2:format_error",
        "HTTP/2 error streams: Stockade's JSON body",
        CHECKED_AGAINST,
        _patch_http2_error_body,
    ),
    Patch(
        f"{_HTTP}._http2:version",
        "HTTP/2 error streams: `server: stockade`",
        CHECKED_AGAINST,
        _patch_http2_server_name,
    ),
    Patch(
        f"{_HTTP}._http2:Http2Connection.protocol_error",
        "GOAWAY without debug text",
        CHECKED_AGAINST,
        _patch_http2_goaway,
    ),
    Patch(
        f"{_HTTP}._http2:Http2Connection._handle_event",
        "HTTP/2 error-stream headers: Stockade's denial headers",
        CHECKED_AGAINST,
        _patch_http2_error_headers,
    ),
    Patch(
        "mitmproxy.http:MessageData.__post_init__",
        "no debug-only type check of every request and response built",
        CHECKED_AGAINST,
        _patch_message_typecheck,
    ),
    Patch(
        "mitmproxy.optmanager:_Option.current",
        "no deep copy of an immutable option value on every read",
        CHECKED_AGAINST,
        _patch_option_copies,
    ),
    Patch(
        "mitmproxy.addonmanager:AddonManager.trigger_event",
        "which addons implement a hook is looked up once per chain, not per call",
        CHECKED_AGAINST,
        _patch_hook_dispatch,
    ),
)


def install(state: PatchState = STATE) -> None:
    """Apply every patch once per process (mitmproxy's classes are shared)."""
    if state.installed:
        return
    for patch in PATCHES:
        patch.install(state)
    state.installed = True


def _refuse_layer_class() -> type:
    from mitmproxy.proxy import commands, events, layer

    class Refuse(layer.Layer):
        """Closes the client connection and ignores everything after."""

        def _handle_event(self, event: Any) -> Any:
            if isinstance(event, events.Start):
                yield commands.CloseConnection(self.context.client)

    return Refuse


def refuse_layer(ctx: Any, state: PatchState = STATE) -> Any:
    """A layer that closes the client connection (its class is built on first use: no
    mitmproxy import before the inspector runs)."""
    if state.refuse is None:
        state.refuse = _refuse_layer_class()
    return state.refuse(ctx)


def tls_config_class() -> type:
    from cryptography import x509
    from mitmproxy.addons.tlsconfig import TlsConfig

    class StockadeTlsConfig(TlsConfig):
        """mitmproxy's TlsConfig, with leaf certificates naming only the SNI (never the
        checked address, which the sandbox has no business seeing)."""

        def get_cert(self, conn_context: Any) -> Any:
            # no SNI: a placeholder; the addon's tls_start_client refuses the handshake
            sni = conn_context.client.sni or "no-sni.stockade.invalid"
            name = x509.DNSName(sni.encode("idna").decode())
            return self.certstore.get_cert(sni, [name], None)

    return StockadeTlsConfig
