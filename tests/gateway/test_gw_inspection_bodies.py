"""A body on a GET or HEAD through the inspector: refused, and nothing of it reaches the
upstream, whether announced (HTTP/1.1 Content-Length, HTTP/2 content-length) or not
(HTTP/2 DATA frames after a GET's HEADERS). A rule allowing only GET ("read-only")
would otherwise pass an upload."""

from __future__ import annotations

import pytest
import test_gw_inspection_smuggling as smuggling
from gw_harness import GatewayHarness
from test_gw_inspection import find_event
from test_gw_inspection_smuggling import (
    RecordingUpstream,
    _h1_answer,
    _h2,
    _h2_answer,
    _req,
    _tunnel,
)

# the smuggling tests' gateway and recording upstream, as fixtures of this module too
sgw = smuggling.sgw
upstream = smuggling.upstream
upstream_ca = smuggling.upstream_ca

pytestmark = [pytest.mark.netns]

MARK = b"exfil-9f3a2c-marker"


def _refused(gw: GatewayHarness, conn: int, method: str) -> None:
    ev = find_event(
        gw, "request_decision", stockade__connection_id=conn, event__reason="protocol_unrecognised"
    )
    assert ev["stockade"]["decision"] == "denied"
    assert ev["message"] == f"a {method} request with a body"


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_h1_get_with_a_body_is_refused(
    sgw: GatewayHarness, upstream: RecordingUpstream, method: str
) -> None:
    upstream.take()
    t, conn = _tunnel(sgw, "http/1.1")
    t.sendall(f"{method} /allowed/b HTTP/1.1\r\nHost: echo.test\r\nContent-Length: "
              f"{len(MARK)}\r\n\r\n".encode() + MARK)
    out = _h1_answer(t)
    t.close()
    assert out.startswith(b"HTTP/1.1 403"), out[:200]
    assert MARK not in upstream.take()
    _refused(sgw, conn, method)


def test_h2_get_with_an_unannounced_body_never_reaches_the_upstream(
    sgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    upstream.take()
    t, conn = _tunnel(sgw, "h2")
    c = _h2(t)
    c.send_headers(1, _req(b"GET", b"/allowed/b"), end_stream=False)
    c.send_data(1, MARK, end_stream=True)
    t.sendall(c.data_to_send())
    _h2_answer(t, c, 1)
    t.close()
    assert MARK not in upstream.take()
    _refused(sgw, conn, "GET")


def test_h2_get_with_an_announced_body_is_refused(
    sgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    upstream.take()
    t, conn = _tunnel(sgw, "h2")
    c = _h2(t)
    c.send_headers(1, _req(b"GET", b"/allowed/b", (b"content-length", str(len(MARK)).encode())),
                   end_stream=False)
    c.send_data(1, MARK, end_stream=True)
    t.sendall(c.data_to_send())
    status, _ = _h2_answer(t, c, 1)
    t.close()
    assert status == b"403"
    assert MARK not in upstream.take()
    _refused(sgw, conn, "GET")


def test_a_get_without_a_body_still_goes_through(
    sgw: GatewayHarness, upstream: RecordingUpstream
) -> None:
    upstream.take()
    t, _ = _tunnel(sgw, "h2")
    c = _h2(t)
    c.send_headers(1, _req(b"GET", b"/allowed/plain"), end_stream=True)
    t.sendall(c.data_to_send())
    status, _ = _h2_answer(t, c, 1)
    t.close()
    assert status == b"200"
    assert b"/allowed/plain" in upstream.take()
