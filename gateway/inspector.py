"""The L7 inspector: a mitmproxy master with a Stockade addon, run as a child process.

`stockade gateway inspector` is started (and restarted) by the gateway service
(`inspector_supervisor.py`); it is not meant to be run by hand. It reads its spec (one
JSON line: rules dir, events file, CA dir, listen address, upstream CAs and the
hand-off signing key) from stdin, prints `{"ready": PORT}` on stdout once it listens,
and exits when stdin closes (the gateway went away).

Why mitmproxy in a child: its proxy core is slow (hundreds of requests/s) and lives on
its own event loop; in a child it can never stall the gateway's listeners, and a crash
costs only the inspected flows (which then fail closed). Only flows whose allow entries
need method/path or `host_must_match_sni` ever come here (see `inspection.py`).

Safety properties, each enforced here and not only by mitmproxy's defaults:
- regular (explicit-proxy) mode on loopback only, `connection_strategy=lazy`,
  `upstream_cert=false`: nothing is dialled before the client's first request, and the
  only thing ever dialled is the checked address the signed hand-off names
  (`server_connect` refuses anything else); no name is resolved (the address is a
  literal; mitmproxy's DNS addons are not loaded).
- the client's SNI must name the flow's host; the upstream gets that SNI and its
  certificate is verified against it (system CAs + `upstream_ca_file`).
- inside the tunnel only HTTP/1.x and HTTP/2 are served: a non-TLS first flight, non-HTTP
  bytes after the handshake, CONNECT and upgrades (websocket, h2c) are refused.
- every request is decided by `inspection.decide_request` on the gateway's rule set
  version, with one `request_decision` event each (same events file, O_APPEND lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from stockade.events import make_event

from .inspection import (
    CA_BASENAME,
    FLOW_HEADER,
    HEALTH_HOST,
    FlowMeta,
    InnerRequest,
    MetaError,
    RequestDecision,
    decide_request,
    decode_meta,
    denial_body,
    request_syntax_error,
)

log = logging.getLogger("stockade.gateway.inspector")
Emit = Callable[[dict[str, Any]], None]

# flow.metadata key: this request was denied at its headers (its body is never read)
DENIED_EARLY = "stockade_denied_early"
RULES_KEPT = 4  # rule set versions kept, so flows decided just before a reload still match
RELOAD_MIN_INTERVAL_S = 0.5


class RulesByVersion:
    """The rule sets the inspector can decide with, by version. A version it does not
    hold is looked for by loading the rules directory again (at most every
    RELOAD_MIN_INTERVAL_S); a flow whose version is not found is denied (never decided on
    other rules)."""

    def __init__(self, rules_dir: str, loader: Callable[[str], RuleSet] | None = None) -> None:
        self.rules_dir = rules_dir
        self._load = loader or _load_rules
        self._sets: OrderedDict[str, RuleSet] = OrderedDict()
        self._last_load = 0.0
        self.latest: RuleSet | None = None

    def load(self) -> RuleSet | None:
        self._last_load = time.monotonic()
        try:
            rs = self._load(self.rules_dir)
        except Exception as e:  # an invalid rule set: keep what we have (fail closed)
            log.warning("inspector: rules not loaded: %s", e)
            return None
        self._sets[rs.version] = rs
        self._sets.move_to_end(rs.version)
        while len(self._sets) > RULES_KEPT:
            self._sets.popitem(last=False)
        self.latest = rs
        return rs

    def get(self, version: str) -> RuleSet | None:
        rs = self._sets.get(version)
        if rs is None and time.monotonic() - self._last_load >= RELOAD_MIN_INTERVAL_S:
            self.load()
            rs = self._sets.get(version)
        return rs


def _load_rules(rules_dir: str) -> RuleSet:
    from stockade.policy import load_rules

    return load_rules(rules_dir)


class StockadeAddon:
    """Decides every request of every handed-over flow; see the module docstring."""

    def __init__(self, key: bytes, rules: RulesByVersion, emit: Emit) -> None:
        self.key = key
        self.rules = rules
        self.emit = emit
        self.flows: dict[str, FlowMeta] = {}  # mitmproxy client connection id -> hand-off
        self.requests_seen = 0  # requests decided (tests: flows without http never come)
        self.handoffs = 0

    # -- the hand-off ---------------------------------------------------------------------
    def http_connect(self, flow: Any) -> None:
        from mitmproxy import http

        cid = flow.client_conn.id
        meta = self.flows.get(cid)
        if meta is not None:  # a CONNECT inside the tunnel
            self._request_event(
                meta, flow, _refused(Reason.PROTOCOL_UNRECOGNISED, meta, "CONNECT inside")
            )
            flow.response = _deny_response(http, Reason.PROTOCOL_UNRECOGNISED, None, meta)
            return
        if FLOW_HEADER not in flow.request.headers and flow.request.host == HEALTH_HOST:
            # the supervisor's liveness probe: answered by the event loop, nothing logged
            flow.response = http.Response.make(403, b"", {"Connection": "close"})
            return
        try:
            meta = decode_meta(flow.request.headers.get(FLOW_HEADER, ""), self.key)
            if (flow.request.host, flow.request.port) != (meta.ip, meta.port):
                raise MetaError("CONNECT target is not the signed address")
        except (MetaError, ValueError) as e:
            # not from the gateway (or a bug): nothing is dialled, nothing is logged as a
            # task's decision (there is no trustworthy task to name)
            log.warning("inspector: hand-off refused: %s", e)
            flow.response = http.Response.make(403, b"", {"Connection": "close"})
            return
        self.flows[cid] = meta
        self.handoffs += 1

    def client_disconnected(self, client: Any) -> None:
        self.flows.pop(client.id, None)

    def next_layer(self, nextlayer: Any) -> None:
        """Inside a handed-over tunnel: TLS first, then HTTP, nothing else."""
        from mitmproxy.proxy.layers import ClientTLSLayer, HttpLayer, ServerTLSLayer

        ctx = nextlayer.context
        meta = self.flows.get(ctx.client.id)
        if meta is None or nextlayer.layer is None:
            return  # before the hand-off (the CONNECT itself), or undecided yet
        layer = nextlayer.layer
        if not ctx.client.tls_established:  # (the TLS layers set `.tls` when built)
            ok = isinstance(layer, ServerTLSLayer | ClientTLSLayer)
            detail = "the tunnel does not start with a TLS ClientHello"
        else:
            ok = isinstance(layer, HttpLayer)
            detail = "non-HTTP bytes inside the TLS tunnel"
        if not ok:
            self._flow_event(meta, Reason.PROTOCOL_UNRECOGNISED, detail)
            nextlayer.layer = _Refuse(ctx)

    def tls_start_client(self, data: Any) -> None:
        """After TlsConfig built the client side: the SNI must name the flow's host."""
        meta = self.flows.get(data.context.client.id)
        if meta is None:
            data.ssl_conn = None  # fails the connection
            return
        sni = data.context.client.sni
        reason = None
        if not sni:
            reason, detail = Reason.SNI_MISSING, "TLS ClientHello without server name"
        elif _norm(sni) != meta.host:
            reason, detail = Reason.DESTINATION_MISMATCH, "SNI names another host"
        if reason is not None:
            self._flow_event(meta, reason, detail)
            data.ssl_conn = None

    def server_connect(self, data: Any) -> None:
        """The only address ever dialled is the one the gateway checked and signed."""
        meta = self.flows.get(data.client.id)
        addr = data.server.address
        if meta is None or addr is None or (addr[0], addr[1]) != (meta.ip, meta.port):
            data.server.error = "stockade: destination not approved by the gateway"

    def tls_start_server(self, data: Any) -> None:
        """After TlsConfig: the upstream SNI (and name verified) is the flow's host."""
        meta = self.flows.get(data.context.client.id)
        sni = data.conn.sni
        if meta is None or not sni or _norm(sni) != meta.host:
            data.ssl_conn = None

    # -- requests -----------------------------------------------------------------------
    def requestheaders(self, flow: Any) -> None:
        from mitmproxy import http

        meta = self.flows.get(flow.client_conn.id)
        if meta is None:
            flow.kill()
            return
        self.requests_seen += 1
        req = flow.request
        syntax = request_syntax_error(req.data.method, req.data.path, req.data.headers.fields)
        if flow.error is not None:
            # mitmproxy's own validation refused the head (duplicate or invalid
            # Content-Length, Content-Length with Transfer-Encoding, ...): it answers 400
            # (with our body, see _install_error_pages); the event says so
            msg = flow.error.msg[:200]
            d = _refused(Reason.PROTOCOL_UNRECOGNISED, meta, msg)
            self._request_event(meta, flow, d, status=400)
            return
        if syntax is not None:  # before anything else: nothing of it may reach the upstream
            d = _refused(Reason.PROTOCOL_UNRECOGNISED, meta, syntax)
        elif not flow.client_conn.tls_established or (req.host, req.port) != (
            meta.ip,
            meta.port,
        ):
            d = _refused(Reason.DESTINATION_MISMATCH, meta, "request outside the checked tunnel")
        else:
            ruleset = self.rules.get(meta.policy_version)
            if ruleset is None:
                d = _refused(
                    Reason.INSPECTION_UNAVAILABLE,
                    meta,
                    f"the inspector has no rule set {meta.policy_version}",
                )
            else:
                d = decide_request(ruleset, meta, inner_request(req))
        self._request_event(meta, flow, d)
        if d.allowed:
            req.stream = True  # bodies go through, never buffered here
            return
        req.stream = False
        # a body still to come is never read: the stream patch (see _install_stream_patch)
        # sends this 403 at once and then resets the stream (HTTP/1: closes the connection)
        flow.response = _deny_response(http, d.reason, d.rule_id, meta)
        flow.metadata[DENIED_EARLY] = True

    def request(self, flow: Any) -> None:
        """The whole request went through (allowed ones stream): trailers are refused (a
        trailer could carry what header checks refuse, and is written verbatim to an
        HTTP/1.1 upstream); they are dropped before they are sent, and the flow ends."""
        meta = self.flows.get(flow.client_conn.id)
        if flow.request.trailers:
            flow.request.trailers = None
            if meta is not None:
                self._request_event(
                    meta, flow, _refused(Reason.PROTOCOL_UNRECOGNISED, meta, "request trailers")
                )
            if flow.killable:
                flow.kill()

    def error(self, flow: Any) -> None:
        """mitmproxy would answer an upstream failure (refused, certificate not valid for
        the name) with an error page naming the address it dialled: the flow is killed
        instead, so the sandbox sees the connection (HTTP/2: the stream) end, and the
        detail goes to the inspector's log only."""
        meta = self.flows.get(flow.client_conn.id)
        if meta is not None and flow.response is None:
            log.warning(
                "inspector: task %s connection %s to %s: %s",
                meta.task_id,
                meta.connection_id,
                meta.host,
                flow.error.msg if flow.error else "error",
            )
        if flow.killable:
            flow.kill()

    def responseheaders(self, flow: Any) -> None:
        if flow.response is not None:
            flow.response.stream = True

    # -- events -----------------------------------------------------------------------------
    def _request_event(
        self, meta: FlowMeta, flow: Any, d: RequestDecision, status: int = 403
    ) -> None:
        req = flow.request
        path = req.path.split("?", 1)[0][:2048]
        extra = {**_flow_extra(meta), "http_version": req.http_version}
        if d.reason == Reason.DESTINATION_MISMATCH:
            extra["request_host"] = (req.headers.get("host") or req.authority or "")[:255]
        self.emit(
            make_event(
                component="gateway",
                action="request_decision",
                decision="allowed" if d.allowed else "denied",
                reason=str(d.reason),
                policy_version=d.policy_version or meta.policy_version,
                rule_id=d.rule_id,
                report_only=d.report_only,
                protocol="http",
                http_method=req.method[:32],
                url={"scheme": "https", "domain": meta.host, "port": meta.port, "path": path},
                http_status=None if d.allowed else status,
                message=d.detail or None,
                extra=extra,
                **_flow_fields(meta),
            )
        )

    def _flow_event(self, meta: FlowMeta, reason: Reason, detail: str) -> None:
        """A refusal of the tunnel itself (no request to name)."""
        self.emit(
            make_event(
                component="gateway",
                action="request_decision",
                decision="denied",
                reason=str(reason),
                policy_version=meta.policy_version,
                protocol="tls",
                message=detail,
                extra=_flow_extra(meta),
                **_flow_fields(meta),
            )
        )


def _flow_fields(meta: FlowMeta) -> dict[str, Any]:
    """The flow's identity in every inspector event: task, source and the checked
    destination the gateway handed over."""
    return {
        "task_id": meta.task_id,
        "profile": meta.profile,
        "source_ip": meta.source_ip or None,
        "source_port": meta.source_port or None,
        "destination_domain": meta.host,
        "destination_ip": meta.ip,
        "destination_port": meta.port,
        "transport": "tcp",
    }


def _flow_extra(meta: FlowMeta) -> dict[str, Any]:
    return {"connection_id": meta.connection_id, "listener": meta.listener, "inspected": True}


def inner_request(req: Any) -> InnerRequest:
    """The decision's view of a mitmproxy request."""
    names = [v for v in req.headers.get_all("host")]
    if req.authority:  # HTTP/2 :authority, or an absolute-form / authority-form target
        names.append(req.authority)
    upgrade = "upgrade" in req.headers or bool(req.headers.get(":protocol"))
    return InnerRequest(req.method, req.path, tuple(names), upgrade)


def _refused(reason: Reason, meta: FlowMeta, detail: str) -> RequestDecision:
    return RequestDecision(False, reason, policy_version=meta.policy_version, detail=detail)


def _deny_response(http: Any, reason: str, rule: str | None, meta: FlowMeta) -> Any:
    return http.Response.make(
        403,
        denial_body(str(reason), rule, meta.task_id),
        {"X-Stockade-Deny": str(reason), "Content-Type": "application/json"},
    )


def _norm(name: str) -> str | None:
    from stockade.policy import HostError, normalize_host

    try:
        return normalize_host(name)
    except HostError:
        return None


_PATCHED = False
_HEAD_CONN: list[Any] = [None]  # the client connection whose HTTP/1 head is being read
_ADDON: StockadeAddon | None = None  # for the patched HTTP/2 protocol_error's event


def _install_stream_patch() -> None:
    """mitmproxy answers a response set in `requestheaders` only after it has read (and
    buffered) the whole request body: a denied upload of any size would sit in the
    inspector's memory. This wraps HttpStream's header state so that, for a request the
    addon denied (DENIED_EARLY) whose body is still to come, the 403 goes out at once, the
    stream is reset (HTTP/2 RST_STREAM; HTTP/1 closes the connection) and whatever body
    arrives later is dropped unread. Checked against mitmproxy 11.0.x."""
    global _PATCHED
    if _PATCHED:
        return
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
    _install_error_pages()
    _PATCHED = True


def _stockade_error_response(status_code: int, message: str = "") -> bytes:
    """mitmproxy's HTTP/1 error page (an HTML page with `Server: mitmproxy <version>` and
    its parser's message) replaced by Stockade's small JSON body; the message goes to the
    inspector's log only."""
    from mitmproxy import http
    from mitmproxy.net.http import http1

    log.info("inspector: client protocol error %s: %s", status_code, message)
    conn, addon = _HEAD_CONN[0], _ADDON
    if conn is not None and addon is not None:
        # an HTTP/1 head mitmproxy could not parse: there is no flow (so no
        # requestheaders event); the denial is logged for the sandbox's connection
        meta = addon.flows.get(conn.id)
        if meta is not None:
            addon._flow_event(
                meta,
                Reason.PROTOCOL_UNRECOGNISED,
                f"unparseable HTTP/1 request head: {message}"[:200],
            )
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


def _install_error_pages() -> None:
    """No mitmproxy error page, version or parser message ever reaches the sandbox:
    HTTP/1 error responses and HTTP/2 error streams carry Stockade's JSON body with
    `Server: stockade`, and an HTTP/2 GOAWAY carries no debug text."""
    import types

    import h2.errors
    from mitmproxy.proxy.commands import Log, SendData
    from mitmproxy.proxy.layers.http import ResponseProtocolError, _http1, _http2

    _http1.make_error_response = _stockade_error_response
    read_headers = _http1.Http1Server.read_headers

    def read_headers_of(self: Any, event: Any) -> Any:
        # the client connection published for _stockade_error_response, which mitmproxy
        # calls without it (no flow exists yet for a head it cannot parse)
        def publish(on: bool) -> None:
            _HEAD_CONN[0] = self.conn if on else None

        return (yield from _stepped(read_headers(self, event), publish))

    _http1.Http1Server.read_headers = read_headers_of  # type: ignore[method-assign]
    _http2.format_error = lambda code, message: denial_body(  # type: ignore[assignment]
        str(Reason.PROTOCOL_UNRECOGNISED), None, None
    )
    _http2.version = types.SimpleNamespace(MITMPROXY="stockade")  # type: ignore[assignment]

    def protocol_error(
        self: Any, message: str, error_code: int = h2.errors.ErrorCodes.PROTOCOL_ERROR
    ) -> Any:
        yield Log(f"inspector: HTTP/2 protocol error: {message}")
        addon = _ADDON
        if addon is not None and self.conn is self.context.client:  # the sandbox's side
            meta = addon.flows.get(self.conn.id)
            if meta is not None:
                addon._flow_event(
                    meta, Reason.PROTOCOL_UNRECOGNISED, "HTTP/2 protocol error (GOAWAY)"
                )
        self.h2_conn.close_connection(error_code)  # no additional_data: no message
        yield SendData(self.conn, self.h2_conn.data_to_send())
        yield from self.close_connection(message)

    _http2.Http2Connection.protocol_error = protocol_error  # type: ignore[method-assign]
    handle_event = _http2.Http2Connection._handle_event

    def handle_event_of(self: Any, event: Any) -> Any:
        if not isinstance(event, ResponseProtocolError):
            return (yield from handle_event(self, event))
        # an error stream: mitmproxy's headers (text/html, its name) swapped for ours while
        # it sends them (the body is format_error's, above)
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


def _refuse_layer_class() -> type:
    from mitmproxy.proxy import commands, events, layer

    class Refuse(layer.Layer):
        """Closes the client connection and ignores everything after."""

        def _handle_event(self, event: Any) -> Any:
            if isinstance(event, events.Start):
                yield commands.CloseConnection(self.context.client)

    return Refuse


def _Refuse(ctx: Any) -> Any:  # a layer "class" built on first use
    global _REFUSE
    if _REFUSE is None:
        _REFUSE = _refuse_layer_class()
    return _REFUSE(ctx)


_REFUSE: type | None = None


def _tls_config_class() -> type:
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


# -- the process -------------------------------------------------------------------------------


def _options(spec: dict[str, Any]) -> dict[str, Any]:
    host, _, port = spec["listen"].rpartition(":")
    return {
        "mode": [f"regular@{host.strip('[]')}:{int(port)}"],
        "confdir": spec["ca_dir"],
        "connection_strategy": "lazy",
        "upstream_cert": False,
        "http2": True,
        "http3": False,
        "websocket": False,
        "rawtcp": True,  # so non-HTTP bytes get a TCP layer, which next_layer refuses
        "ssl_insecure": False,
        "ssl_verify_upstream_trusted_ca": spec.get("upstream_ca_file"),
        "ssl_verify_upstream_trusted_confdir": spec.get("system_ca_dir"),
        "validate_inbound_headers": True,
        "stream_large_bodies": None,
        "block_global": True,
        "block_private": False,
    }


async def run_inspector(spec: dict[str, Any], stdin_eof: asyncio.Event | None = None) -> None:
    from mitmproxy import options
    from mitmproxy.addons import block, core, disable_h2c, next_layer, proxyserver
    from mitmproxy.master import Master

    key = bytes.fromhex(spec["key"])
    from stockade.config import EventSettings

    ev = EventSettings.model_validate(spec.get("events", {}))
    # stdout is the ready channel
    writer = ev.writer(spec.get("events_file"), spec.get("task_dir"), stdout=False)
    rules = RulesByVersion(spec["rules_dir"])
    rules.load()
    _install_stream_patch()
    opts = options.Options()
    master = Master(opts)
    addon = StockadeAddon(key, rules, writer.write)
    global _ADDON
    _ADDON = addon
    master.addons.add(
        core.Core(),
        block.Block(),
        disable_h2c.DisableH2C(),
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),
        _tls_config_class()(),
        addon,
    )
    opts.update(**_options(spec))

    class Ready:
        def running(self) -> None:
            ps = master.addons.get("proxyserver")
            addrs = ps.listen_addrs()
            port = addrs[0][1] if addrs else 0
            sys.stdout.write(json.dumps({"ready": port}) + "\n")
            sys.stdout.flush()
            # nobody reads the pipe from here on: anything else written to stdout goes to
            # stderr, so a full pipe can never block the inspector
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    master.addons.add(Ready())
    if stdin_eof is not None:

        async def watch() -> None:
            await stdin_eof.wait()
            master.shutdown()

        watcher = asyncio.ensure_future(watch())
    try:
        await master.run()
    finally:
        if stdin_eof is not None:
            watcher.cancel()
        writer.close()


def main() -> int:
    """`stockade gateway inspector`: the spec is the first line on stdin."""
    line = sys.stdin.buffer.readline()
    try:
        spec = json.loads(line)
        for k in ("key", "rules_dir", "ca_dir", "listen"):
            if not isinstance(spec.get(k), str):
                raise ValueError(k)
        if not (Path(spec["ca_dir"]) / f"{CA_BASENAME}-ca.pem").exists():
            raise ValueError("no CA in ca_dir (the gateway creates it)")
    except ValueError as e:
        sys.stderr.write(f"stockade gateway inspector: bad spec on stdin: {e}\n")
        return 2
    logging.basicConfig(
        level=spec.get("log_level", "WARNING"),
        stream=sys.stderr,
        format="%(asctime)s inspector %(name)s %(levelname)s %(message)s",
    )

    async def go() -> None:
        eof = asyncio.Event()
        loop = asyncio.get_running_loop()
        fd = sys.stdin.fileno()

        def readable() -> None:
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(fd)
                eof.set()

        loop.add_reader(fd, readable)
        await run_inspector(spec, eof)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(go())
    return 0
