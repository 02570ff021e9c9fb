"""The TCP path's stages without sockets: first flight, route, refusal bytes, start."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from gw_tlsgen import hello_with_sni
from stockade.gateway.conn_events import ConnEvents
from stockade.gateway.deny import TLS_ALERT_ACCESS_DENIED, http_denial
from stockade.gateway.flow import FlowDecision
from stockade.gateway.metrics import GatewayMetrics
from stockade.gateway.sniff_http import HttpSniffer, RequestHead
from stockade.gateway.tcp.conn import IDLE_TIMEOUT, SHUTDOWN, ConnTable, unmap_ip
from stockade.gateway.tcp.flight import FirstFlight, Sniffed
from stockade.gateway.tcp.listener import accept_burst
from stockade.gateway.tcp.refuse import denial, refusal_bytes
from stockade.gateway.tcp.route import (
    InspectorState,
    choose_route,
    connect_route,
    inspectable,
    refuse_framing,
    why_uninspected,
)
from stockade.gateway.tcp.start import first_bytes
from stockade.policy.reasons import Reason

from stockade.tasks import Task

UP = InspectorState(True, True, "")
DOWN = InspectorState(True, False, "the inspector exited (code 1) and is being restarted")
OFF = InspectorState(False, False, "")
R = Reason.NO_MATCHING_RULE


def _flight(chunks: list[bytes], cap: int = 16384, **kw: object) -> Sniffed | None:
    flight = FirstFlight(cap, **kw)  # type: ignore[arg-type]
    done = flight.begin()
    for chunk in chunks:
        if done is not None:
            break
        done = flight.feed(chunk)
    return done


# -- first flight --------------------------------------------------------------------------
def test_flight_tls_hello_split_across_chunks() -> None:
    hello = hello_with_sni("pypi.test")
    done = _flight([hello[:3], hello[3:20], hello[20:] + b"after"])
    assert done is not None and done.error is None and done.kind == "tls"
    assert done.tls is not None and done.tls.sni == "pypi.test"
    assert done.data == hello + b"after"  # every byte read, replayed upstream


def test_flight_http_head_with_initial_bytes() -> None:
    head = b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n"
    done = FirstFlight(16384, initial=head).begin()
    assert done is not None and done.kind == "http" and done.http is not None
    assert done.http.host_header == "a.test" and done.data == head


def test_flight_needs_more_then_closed_or_timeout() -> None:
    ends = (("closed", Reason.PROTOCOL_UNRECOGNISED), ("timeout", Reason.SNIFF_TIMEOUT))
    for end, reason in ends:
        flight = FirstFlight(16384)
        assert flight.begin() is None
        assert flight.feed(b"GET / HTT") is None
        done = getattr(flight, end)()
        assert done.error is not None and done.error.reason == reason
        assert done.kind == "http" and done.data == b"GET / HTT"


def test_flight_neither_tls_nor_http() -> None:
    done = _flight([b"\x00\x01garbage"])
    assert done is not None and done.error is not None
    assert (done.error.reason, done.error.detail) == (
        Reason.PROTOCOL_UNRECOGNISED,
        "neither TLS nor HTTP",
    )


def test_flight_http_only_refuses_a_client_hello() -> None:
    done = _flight([hello_with_sni("a.test")], http_only=True)
    assert done is not None and done.error is not None and done.kind is None
    assert done.error.reason == Reason.PROTOCOL_UNRECOGNISED


def test_flight_over_the_cap() -> None:
    cap = 64
    done = _flight([b"GET /" + b"a" * 200, b"b" * 200], cap=cap)
    assert done is not None and done.error is not None
    assert done.error.reason == Reason.HEAD_TOO_LARGE


# -- route ---------------------------------------------------------------------------------
def _d(allowed: bool = True, reason: Reason = Reason.ALLOWED_BY_RULE, **kw: object) -> FlowDecision:
    fields = {"protocol": "tls", "port": 443, "host": "a.test", "rule_id": "r1", **kw}
    return FlowDecision(allowed, reason, **fields)  # type: ignore[arg-type]


L7 = Reason.INSPECTION_UNAVAILABLE


def test_inspectable_only_named_flows_while_the_inspector_is_up() -> None:
    assert inspectable(_d(False, L7), UP)
    assert not inspectable(_d(False, L7), DOWN)
    assert not inspectable(_d(False, L7), OFF)
    assert not inspectable(_d(False, L7, host=None, ip="192.0.2.1"), UP)
    assert not inspectable(_d(False, L7, protocol="http"), UP)
    assert inspectable(_d(False, L7, protocol="tcp"), UP, "tcp")
    assert not inspectable(_d(False, R), UP)


def test_why_uninspected_names_the_inspector_state() -> None:
    assert why_uninspected(_d(), UP) == _d()
    off = why_uninspected(_d(True, L7, report_only=True, detail="needs path"), OFF)
    assert (off.allowed, off.report_only) == (False, False)
    assert off.detail == "needs path: L7 inspection is disabled (gateway.inspection.enabled)"
    assert why_uninspected(_d(False, L7, protocol="http"), UP).detail == (
        "the plain-HTTP request head gives no path to decide on"
    )
    assert why_uninspected(_d(False, L7), DOWN).detail == DOWN.why
    assert why_uninspected(_d(False, L7), InspectorState(True, False, "")).detail == (
        "the inspector is not ready"
    )


def _head(raw: bytes) -> RequestHead:
    head = HttpSniffer(16384).feed(raw)
    assert isinstance(head, RequestHead)
    return head


def test_refuse_framing() -> None:
    te = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked = Sniffed(http=_head(te))
    counted = Sniffed(http=_head(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\n"))
    d = _d(protocol="http", port=80)
    refused = refuse_framing(d, chunked)
    assert (refused.allowed, refused.reason) == (False, Reason.PROTOCOL_UNRECOGNISED)
    assert refused.detail.endswith("(chunked)")
    assert refuse_framing(d, counted) is d
    assert refuse_framing(_d(False, R, protocol="http"), chunked).reason == R
    assert refuse_framing(_d(), chunked) == _d()  # a TLS flow: not the plain-HTTP rule


def test_a_body_on_get_or_head_is_refused() -> None:
    """A rule that allows only GET must not pass an upload on a GET."""
    d = _d(protocol="http", port=80)
    for method in ("GET", "HEAD"):
        upload = Sniffed(http=_head(
            method.encode() + b" / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n"))
        refused = refuse_framing(d, upload)
        assert (refused.allowed, refused.reason) == (False, Reason.PROTOCOL_UNRECOGNISED)
        assert refused.detail == f"a {method} request with a body"
        empty = Sniffed(http=_head(
            method.encode() + b" / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n"))
        assert refuse_framing(d, empty) is d
        assert refuse_framing(d, Sniffed(http=_head(
            method.encode() + b" / HTTP/1.1\r\nHost: a\r\n\r\n"))) is d
    post = Sniffed(http=_head(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n"))
    assert refuse_framing(d, post) is d


def test_choose_route_ladder() -> None:
    allowed = _d()
    assert choose_route(_d(False, L7), None, False, UP).action == "inspect"
    refused = choose_route(_d(True, L7, report_only=True), None, False, DOWN)
    assert refused.action == "refuse" and not refused.decision.allowed
    assert choose_route(_d(False, R), None, False, UP) == ("refuse", _d(False, R))
    assert choose_route(allowed, allowed, True, UP) == ("early", allowed)
    assert choose_route(allowed, _d(host="b.test"), True, UP) == ("dial", allowed)
    assert choose_route(allowed, allowed, False, UP) == ("dial", allowed)
    assert choose_route(allowed, None, False, OFF) == ("dial", allowed)


def test_connect_route() -> None:
    pre = _d(protocol="tcp")
    assert connect_route(pre, UP) == (None, False)
    assert connect_route(_d(False, L7, protocol="tcp"), UP) == (None, True)
    refused, l7 = connect_route(_d(False, L7, protocol="tcp"), OFF)
    assert refused is not None and not l7 and "disabled" in refused.detail
    assert connect_route(_d(False, R, protocol="tcp"), UP) == (_d(False, R, protocol="tcp"), False)


# -- refusal -------------------------------------------------------------------------------
HTTP = http_denial(R, None, "t1")
REFUSALS = [
    # (exit, listener, tunnel, protocol, rule, status, expected bytes)
    ("proxy head unreadable", "proxy", False, "http", None, 403, HTTP),
    ("proxy head not absolute", "proxy", False, "http", None, 403, HTTP),
    ("unknown task / limit, proxy", "proxy", False, "http", None, 403, HTTP),
    ("unknown task / limit, transparent TLS", "transparent", False, "tls", None, 403,
     TLS_ALERT_ACCESS_DENIED),
    ("unknown task / limit, transparent HTTP", "transparent", False, "http", None, 403, HTTP),
    ("unknown task / limit, transparent TCP", "transparent", False, "tcp", None, 403, b""),
    ("CONNECT authority denied", "proxy", False, "tcp", "r1", 403, http_denial(R, "r1", "t1")),
    ("name guard before the 200", "proxy", False, "tcp", "r1", 403, http_denial(R, "r1", "t1")),
    ("name guard inside the tunnel", "proxy", True, "tls", "r1", 403, TLS_ALERT_ACCESS_DENIED),
    ("decided inside the tunnel, raw", "proxy", True, "tcp", "r1", 403, b""),
    ("decided, transparent HTTP", "transparent", False, "http", "r1", 403,
     http_denial(R, "r1", "t1")),
    ("dial failed, plain HTTP", "transparent", False, "http", "r1", 502,
     http_denial(R, "r1", "t1", status=502)),
    ("dial failed, TLS", "proxy", True, "tls", "r1", 502, TLS_ALERT_ACCESS_DENIED),
]


@pytest.mark.parametrize(("exit_", "listener", "tunnel", "protocol", "rule", "status", "want"),
                         REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusal_bytes(exit_: str, listener: str, tunnel: bool, protocol: str,
                       rule: str | None, status: int, want: bytes) -> None:
    assert refusal_bytes(listener, tunnel, protocol, R, rule, "t1", status) == want  # type: ignore[arg-type]


def test_refusal_bytes_502_status_line() -> None:
    raw = refusal_bytes("proxy", False, "http", Reason.UPSTREAM_UNREACHABLE, None, None, 502)
    assert raw.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
    assert b"X-Stockade-Deny: upstream_unreachable\r\n" in raw


def test_denial_keeps_the_destination_not_the_verdict() -> None:
    d = _d(report_only=True, policy_version="v3", detail="allowed")
    out = denial(d, Reason.RESOLVE_FAILED, "resolution failed: no address")
    assert out == FlowDecision(False, Reason.RESOLVE_FAILED, "tls", 443, host="a.test",
                               rule_id="r1", policy_version="v3",
                               detail="resolution failed: no address")


# -- start ---------------------------------------------------------------------------------
def test_first_bytes_tls_is_replayed_unchanged() -> None:
    inner = Sniffed(data=b"\x16hello and more")
    assert first_bytes(inner, _d()) == (b"\x16hello and more", None)


def test_first_bytes_plain_http_is_one_request() -> None:
    req = b"POST /u HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\n"
    data = req + b"abcGET /second HTTP/1.1\r\n"
    inner = Sniffed(data=data, http=_head(data))
    sent, limit = first_bytes(inner, _d(protocol="http", port=80))
    want = b"POST /u HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc"
    assert (sent, limit) == (want, len(want))


# -- the connection table ----------------------------------------------------------------------
def test_conn_table_limit_upload_cap_and_idle() -> None:
    limits = SimpleNamespace(limits=SimpleNamespace(egress_bytes=10))
    rules = SimpleNamespace(current=SimpleNamespace(profiles={"p": limits}))
    table = ConnTable(rules)  # type: ignore[arg-type]
    task = SimpleNamespace(task_id="t1", profile="p")
    a, b = socket.socketpair()
    try:
        c1 = table.open("transparent", a, ("::ffff:10.0.0.1", 1))
        c2 = table.open("transparent", b, ("10.0.0.1", 2))
        assert c1.peer == ("10.0.0.1", 1) and c1.id != c2.id
        c1.task = c2.task = task  # type: ignore[assignment]
        assert table.admit(c1, task, 1)  # type: ignore[arg-type]
        assert not table.admit(c2, task, 1)  # type: ignore[arg-type]
        assert table.count_up(task, 10) and not table.count_up(task, 1)  # type: ignore[arg-type]
        table.relay_started(c1)
        c1.last_activity = 0.0
        assert c1.relaying and table.relaying == 1
        table.close_idle(1.0)
        assert c1.close_reason == IDLE_TIMEOUT and c2.close_reason is None
        table.forget(c1)
        assert "t1" not in table.by_task and table.conns == {c2}
        table.forget(c1)  # forgotten twice (a handler's finally after a close): counted once
        table.forget(c2)  # never relayed: not in the live count
        assert table.relaying == 0 and not table.conns
    finally:
        a.close()
        b.close()


def test_unmap_ip() -> None:
    assert unmap_ip("::ffff:192.0.2.7") == "192.0.2.7"
    assert unmap_ip("fe80::1%eth0") == "fe80::1"
    assert unmap_ip("not-an-ip") == "not-an-ip"


def test_conn_table_task_end_closes_the_connections_over_its_limit() -> None:
    # refused over the limit, such a connection still waits for its first bytes (to be
    # refused in its own protocol): the task's end must cut it short too
    table = ConnTable(SimpleNamespace())  # type: ignore[arg-type]
    task = SimpleNamespace(task_id="t1", profile="p")
    a, b = socket.socketpair()
    try:
        admitted = table.open("transparent", a, ("10.0.0.1", 1))
        over = table.open("transparent", b, ("10.0.0.1", 2))
        admitted.task = over.task = task  # type: ignore[assignment]
        assert table.admit(admitted, task, 1)  # type: ignore[arg-type]
        assert not table.admit(over, task, 1)  # type: ignore[arg-type]
        table.close_task("t1", Reason.TASK_ENDED)
        assert admitted.close_reason == over.close_reason == Reason.TASK_ENDED
        table.forget(admitted)
        table.forget(over)
        assert not table.by_task and not table.over_limit and not table.conns
    finally:
        a.close()
        b.close()


# -- a connection that ends before its decision --------------------------------------------------
@pytest.mark.parametrize(("close_reason", "decided_as"), [
    (None, Reason.PROTOCOL_UNRECOGNISED),  # the socket failed first
    (Reason.TASK_ENDED, Reason.TASK_ENDED),
    (Reason.INTERNAL_ERROR, Reason.INTERNAL_ERROR),  # a bug must not lose the flow
    (SHUTDOWN, None),
])
def test_cut_short_decides_once(close_reason: str | None, decided_as: Reason | None) -> None:
    written: list[dict[str, object]] = []
    events = ConnEvents(GatewayMetrics(), written.append, written.append)
    task = Task("t-cut", "10.0.0.1", "p")
    a, b = socket.socketpair()
    try:
        conn = ConnTable(SimpleNamespace()).open(  # type: ignore[arg-type]
            "transparent", a, ("10.0.0.1", 5))
        conn.task, conn.close_reason = task, close_reason
        conn.meta["orig"] = ("192.0.2.1", 443)
        events.cut_short(conn, "v1")
        events.cut_short(conn, "v1")  # once only
    finally:
        a.close()
        b.close()
    if decided_as is None:
        assert written == []
        return
    (ev,) = written
    assert ev["event"]["reason"] == decided_as  # type: ignore[index]
    assert ev["stockade"]["decision"] == "denied"  # type: ignore[index]
    assert ev["labels"]["task_id"] == "t-cut"  # type: ignore[index]
    assert ev["destination"]["port"] == 443  # type: ignore[index]


def test_accept_burst_skips_a_connection_aborted_in_the_queue() -> None:
    # ECONNABORTED is that one connection's end, not the listener's: no back-off
    a, b = socket.socketpair()
    results: list[object] = [ConnectionAbortedError(), (a, ("10.0.0.1", 1)), BlockingIOError()]

    def accept() -> object:
        r = results.pop(0)
        if isinstance(r, BaseException):
            raise r
        return r

    paused: list[float] = []
    listening = SimpleNamespace(kind="transparent", sock=SimpleNamespace(accept=accept),
                                pause=paused.append)
    got: list[tuple[object, ...]] = []
    try:
        accept_burst(listening, lambda *args: got.append(args))  # type: ignore[arg-type]
    finally:
        a.close()
        b.close()
    assert got == [("transparent", a, ("10.0.0.1", 1))]
    assert paused == [] and results == []
