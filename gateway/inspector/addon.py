"""The inspector's mitmproxy addon: decides every request of every handed-over flow.

Safety properties, each enforced here and not only by mitmproxy's defaults (the options
that go with them are in `child.py`):
- nothing is dialled before the client's ClientHello names the flow's host (with
  `inspection.upstream_first` off: before the client's first request), and the only
  thing ever dialled is the checked address the signed hand-off names (`server_connect`
  refuses anything else); no name is resolved (the address is a literal).
- the client's SNI must name the flow's host; the upstream gets that SNI and its
  certificate is verified against it (system CAs + `upstream_ca_file`).
- inside the tunnel only HTTP/1.x and HTTP/2 are served: a non-TLS first flight, non-HTTP
  bytes after the handshake, CONNECT and upgrades (websocket, h2c) are refused.
- every request is decided by `requests.decide_request` on the gateway's rule set
  version, with one `request_decision` event each (same events file, O_APPEND lines).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from stockade.policy.reasons import Reason
from stockade.policy.ruleset import RuleSet

from stockade.events import make_event

from ..sniff_http import BODYLESS_METHODS
from .handoff import FLOW_HEADER, HEALTH_HOST, FlowMeta, MetaError, decode_meta
from .patches import DENIED_EARLY, refuse_layer
from .requests import (
    InnerRequest,
    RequestDecision,
    decide_request,
    declares_body,
    denial_body,
    request_syntax_error,
)

log = logging.getLogger("stockade.gateway.inspector")
Emit = Callable[[dict[str, Any]], None]

__all__ = ["DENIED_EARLY", "RULES_KEPT", "RulesByVersion", "StockadeAddon", "inner_request"]

BODY_DROPPED = "stockade_body_dropped"  # flow metadata: a GET's or HEAD's body was held back
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

    def __init__(
        self, key: bytes, rules: RulesByVersion, emit: Emit, upstream_first: bool = True
    ) -> None:
        self.key = key
        self.upstream_first = upstream_first
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
            nextlayer.layer = refuse_layer(ctx)

    def tls_clienthello(self, data: Any) -> None:
        """Upstream first (see InspectionSettings.upstream_first), only for a ClientHello
        whose SNI names the flow's host: any other is refused in tls_start_client before
        anything is dialled, so its refusal and event come first, as with the lazy order."""
        meta = self.flows.get(data.context.client.id)
        sni = data.client_hello.sni
        if self.upstream_first and meta is not None and sni and _norm(sni) == meta.host:
            data.establish_server_tls_first = True

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
            # (with our body, see patches.py); the event says so
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
        bodyless = req.method in BODYLESS_METHODS
        if d.allowed and bodyless and declares_body(req.data.headers.fields):
            d = _refused(Reason.PROTOCOL_UNRECOGNISED, meta, f"a {req.method} request with a body")
        self._request_event(meta, flow, d)
        if d.allowed:
            # bodies go through, never buffered here; a GET's or HEAD's never (HTTP/2 can
            # send one without announcing it): the request hook refuses the flow
            req.stream = _no_body(flow) if bodyless else True
            return
        req.stream = False
        # a body still to come is never read: the stream patch (patches.py)
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
            why = "request trailers"
        elif flow.metadata.get(BODY_DROPPED):
            why = f"a {flow.request.method} request with a body"
        else:
            return
        if meta is not None:
            self._request_event(meta, flow, _refused(Reason.PROTOCOL_UNRECOGNISED, meta, why))
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


def _no_body(flow: Any) -> Callable[[bytes], list[bytes]]:
    """The request stream of a GET or HEAD: nothing of a body goes upstream (an empty
    chunk written to an HTTP/1.1 upstream would end a chunked body); its first byte
    marks the flow for the request hook."""

    def drop(chunk: bytes) -> list[bytes]:
        if chunk:
            flow.metadata[BODY_DROPPED] = True
        return []

    return drop


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
