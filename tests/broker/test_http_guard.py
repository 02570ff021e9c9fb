"""The broker's listener under abuse, over real sockets with a real OpenBao and HTTPS
upstream: slow heads, slow bodies, oversized heads, and the per-task in-flight cap.

Server deadlines are short (2 s) and each slow client trickles for up to 60 s, a window
the test controls: it asserts that the broker cut the connection inside that window and
wrote the event, never how fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from polling import async_wait_until

from stockade.testing.devvault import DevOpenBao

from .conftest import (
    Harness,
    Upstream,
    assert_nothing_leaked,
    start_harness,
    stop_harness,
)

pytestmark = pytest.mark.vault

TRICKLE_WINDOW_S = 60.0  # the test's own deadline: far above the broker's 2 s
GUARD_SETTINGS = {"request_header_timeout_s": 2.0, "request_body_timeout_s": 2.0,
                  "max_concurrent_calls_per_task": 4,
                  # calls parked at the slow upstream wait for the test, not for a timeout
                  "upstream_timeout_s": TRICKLE_WINDOW_S}


@pytest.fixture
async def guarded(
    tmp_path: Path,
    bao: DevOpenBao,
    upstream: Upstream,
    tls: tuple[ssl.SSLContext, str],
    caplog: pytest.LogCaptureFixture,
) -> AsyncIterator[Harness]:
    caplog.set_level(logging.DEBUG)
    h, runner = await start_harness(tmp_path, bao, upstream, tls[1], settings=GUARD_SETTINGS)
    try:
        yield h
    finally:
        upstream.gate.set()  # never leave a parked upstream call behind
        await stop_harness(h, runner)
        assert_nothing_leaked(h, caplog.text)


def calls(h: Harness) -> list[dict[str, Any]]:
    return [e for e in h.event_list() if e["event"]["action"] == "broker_call"]


def metric(h: Harness, sample: str) -> float:
    for line in h.broker.metrics.render().decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.split(" ")[1])
    return 0.0


async def open_conn(h: Harness) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = h.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def trickle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, drip: bytes
) -> tuple[bool, bytes]:
    """Send `drip` every 0.25 s until the broker closes the connection or the test's
    window ends. Returns (closed by the broker, bytes it sent)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + TRICKLE_WINDOW_S
    got = bytearray()
    try:
        while loop.time() < end:
            if drip:
                writer.write(drip)
                await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(65536), 0.25)
            except TimeoutError:
                continue
            if not data:
                return True, bytes(got)
            got += data
    except (ConnectionResetError, BrokenPipeError):
        return True, bytes(got)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return False, bytes(got)


def assert_denial(out: bytes, status: int, reason: str) -> None:
    """A response the broker managed to deliver before closing is a legible denial."""
    if not out:
        return  # the close raced the answer away (RST over unread input): allowed
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), out[:200]
    assert f"X-Stockade-Deny: {reason}".encode() in head
    assert json.loads(body)["reason"] == reason


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length)
    return int(head.split(b" ", 2)[1]), body


# -- slow heads ----------------------------------------------------------------------------
@pytest.mark.parametrize("drip", [b"X-Slow: y\r\n", b"x", b""], ids=["lines", "bytes", "silent"])
async def test_slow_head_is_cut_with_an_event_and_others_are_served(
    guarded: Harness, drip: bytes
) -> None:
    h = guarded
    reader, writer = await open_conn(h)
    writer.write(b"GET /echo/json HTTP/1.1\r\nHost: broker\r\n" if drip else b"")
    slow = asyncio.create_task(trickle(reader, writer, drip))
    # while the slow client holds its connection, an ordinary caller is served
    status, _hd, _b = await h.call("GET", "/echo/json/other")
    assert status == 200
    closed, out = await slow
    assert closed, "a trickled head outlived the header deadline"
    h.produced.append(out)
    assert_denial(out, 408, "request_timeout")
    denied = [e for e in calls(h) if e["event"]["reason"] == "request_timeout"]
    assert len(denied) == 1
    ev = denied[0]
    assert ev["event"]["outcome"] == "failure"
    assert ev["http"]["response"]["status_code"] == 408
    assert ev["stockade"]["phase"] == "head"
    assert ev["labels"]["task_id"] == "t1" and ev["source"]["ip"] == "127.0.0.1"
    assert metric(h, 'stockade_broker_calls_total{api="-",outcome="request_timeout"}') == 1
    assert len(h.upstream.seen) == 1  # only the ordinary call went upstream


async def test_second_keepalive_head_is_timed_too(guarded: Harness) -> None:
    h = guarded
    reader, writer = await open_conn(h)
    writer.write(b"GET /echo/json/first HTTP/1.1\r\nHost: broker\r\n\r\n")
    status, body = await read_response(reader)
    h.produced.append(body)
    assert status == 200
    writer.write(b"GET /echo/json/second HTTP/1.1\r\n")  # the next head, then a trickle
    closed, out = await trickle(reader, writer, b"X-Slow: y\r\n")
    h.produced.append(out)
    assert closed
    assert_denial(out, 408, "request_timeout")
    assert [e["event"]["reason"] for e in calls(h)] == ["allowed_by_rule", "request_timeout"]
    assert [d["path"] for d in h.upstream.seen] == ["/json/first"]


# -- slow bodies ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target", "api"), [(b"/echo/json", "echo"), (b"/v1/call", None)], ids=["passthrough", "v1"]
)
async def test_slow_body_is_cut_with_an_event(
    guarded: Harness, target: bytes, api: str | None
) -> None:
    h = guarded
    reader, writer = await open_conn(h)
    writer.write(b"POST " + target + b" HTTP/1.1\r\nHost: broker\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 900\r\n\r\n{")
    slow = asyncio.create_task(trickle(reader, writer, b" "))
    status, _doc = await h.v1({"api": "echo", "path": "/json/meanwhile"})
    assert status == 200
    closed, out = await slow
    assert closed, "a trickled body outlived the body deadline"
    h.produced.append(out)
    assert_denial(out, 408, "request_timeout")
    ev = [e for e in calls(h) if e["event"]["reason"] == "request_timeout"]
    assert len(ev) == 1
    assert ev[0]["stockade"]["phase"] == "body" and ev[0]["labels"]["task_id"] == "t1"
    assert ev[0]["stockade"].get("api") == api
    assert [d["path"] for d in h.upstream.seen] == ["/json/meanwhile"]
    assert h.broker.inflight.counts == {}  # the slot went back


# -- oversized and malformed heads ---------------------------------------------------------
MARK = "leakmark-"  # caller bytes the denial must not quote back (nor the logs)


@pytest.mark.parametrize(
    ("request_bytes", "status", "reason", "error"),
    [
        (f"GET /echo/json HTTP/1.1\r\nHost: b\r\nX-Big: {MARK * 1000}\r\n\r\n",
         431, "head_too_large", "LineTooLong"),
        (f"GET /echo/json HTTP/1.1\r\nHost: b\r\nX-{MARK * 1000}: v\r\n\r\n",
         431, "head_too_large", "LineTooLong"),
        (f"GET /echo/{MARK * 1000} HTTP/1.1\r\nHost: b\r\n\r\n",
         431, "head_too_large", "LineTooLong"),
        ("GET /echo/json HTTP/1.1\r\nHost: b\r\n"
         + "".join(f"X-{MARK}{i}: v\r\n" for i in range(150)) + "\r\n",
         431, "head_too_large", "BadHttpMessage"),
        (f"GET /echo/json HTTP/1.1\r\nHost: b\r\n{MARK}no-colon\r\n\r\n",
         400, "bad_request", "BadHttpMessage"),
    ],
    ids=["long-value", "long-name", "long-target", "too-many", "malformed"],
)
async def test_oversized_or_malformed_head_is_a_denial_with_an_event(
    guarded: Harness, caplog: pytest.LogCaptureFixture,
    request_bytes: str, status: int, reason: str, error: str,
) -> None:
    h = guarded
    out = await h.raw(request_bytes.encode())
    head, _, body = out.partition(b"\r\n\r\n")
    # HTTP/1.0: aiohttp answers a head it could not parse as version-less
    assert head.split(b" ", 2)[:2] in ([b"HTTP/1.0", str(status).encode()],
                                       [b"HTTP/1.1", str(status).encode()]), out[:300]
    assert f"X-Stockade-Deny: {reason}".encode() in head
    assert json.loads(body)["reason"] == reason
    assert MARK.encode() not in out and MARK not in caplog.text
    ev = calls(h)
    assert len(ev) == 1 and ev[0]["event"]["reason"] == reason
    assert ev[0]["http"]["response"]["status_code"] == status
    assert ev[0]["stockade"]["phase"] == "head" and ev[0]["labels"]["task_id"] == "t1"
    assert ev[0]["error"]["type"].endswith(error)  # class name only
    assert MARK not in json.dumps(ev)
    assert metric(h, f'stockade_broker_calls_total{{api="-",outcome="{reason}"}}') == 1
    assert h.upstream.seen == []
    status2, _hd, _b = await h.call("GET", "/echo/json")  # and the broker carries on
    assert status2 == 200


async def test_head_within_the_limits_is_served(guarded: Harness) -> None:
    h = guarded
    status, _hd, _b = await h.call("GET", "/echo/json", headers={"X-Big": "v" * 8000})
    assert status == 200


# -- the per-task in-flight cap ------------------------------------------------------------
async def wait_until(cond: Any, what: str) -> None:
    await async_wait_until(cond, TRICKLE_WINDOW_S, 0.02, what=f"never happened: {what}")


async def test_concurrency_cap_per_task_with_a_slow_upstream(guarded: Harness) -> None:
    h = guarded
    held = [asyncio.create_task(h.call("GET", f"/echo/slow/{i}")) for i in range(4)]
    await wait_until(lambda: h.upstream.parked == 4, "4 calls parked at the slow upstream")
    assert h.broker.inflight.counts == {"t1": 4}
    status, headers, body = await h.call("GET", "/echo/json/fifth")
    assert (status, json.loads(body)["reason"]) == (429, "concurrency_limit")
    assert headers["X-Stockade-Deny"] == "concurrency_limit" and int(headers["Retry-After"]) >= 1
    status, doc = await h.v1({"api": "echo", "path": "/json/sixth"})
    assert (status, doc["reason"]) == (429, "concurrency_limit")
    # another task is not affected by t1's full slots
    status, doc = await h.v1({"api": "echoh", "path": "/json"}, local="127.0.0.3")
    assert status == 200 and doc["status"] == 200
    h.upstream.gate.set()
    assert [r[0] for r in await asyncio.gather(*held)] == [200] * 4
    assert h.broker.inflight.counts == {}
    status, _hd, _b = await h.call("GET", "/echo/json/after")
    assert status == 200
    denied = [e for e in calls(h) if e["event"]["reason"] == "concurrency_limit"]
    assert len(denied) == 2
    assert all(e["http"]["response"]["status_code"] == 429 and e["labels"]["task_id"] == "t1"
               and e["event"]["outcome"] == "failure" for e in denied)
    assert metric(h, 'stockade_broker_calls_total{api="-",outcome="concurrency_limit"}') == 2
    assert metric(h, 'stockade_broker_calls_total{api="echo",outcome="allowed_by_rule"}') == 5
