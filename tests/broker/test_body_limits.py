"""Request bodies are limited before they are read: Content-Length over the profile's
limit is refused before the body is sent (no `100 Continue`), a chunked body is cut at the
limit, a task's bodies in memory draw from one budget, and many held oversized calls of one
task do not grow the broker's memory (real OpenBao, real sockets; broker/body.py)."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import ssl
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from polling import async_wait_until
from stockade.broker.body import ENVELOPE, BodyBudget, BodyLimit, call_doc_limit
from stockade.policy.model import BrokerGrant

from stockade.testing.devvault import DevOpenBao

from .conftest import Harness, Upstream, start_harness, stop_harness
from .test_http_guard import assert_denial, open_conn, read_response

HEAD = (b"POST /v1/call HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
# the harness's `agent` profile grants max_body 1 KiB: its call documents stay under this
AGENT_LIMIT = 1024 * 6 + ENVELOPE
ANSWER_WINDOW_S = 30.0  # the test's own deadline for an answer, not a speed requirement


# -- pure --------------------------------------------------------------------------------------
def test_call_doc_limit_follows_the_largest_grant() -> None:
    grants = [BrokerGrant("a", (), max_body_bytes=1024), BrokerGrant("b", (), max_body_bytes=4096)]
    assert call_doc_limit(grants, 16 * 2**20) == 4096 * 6 + ENVELOPE
    assert call_doc_limit(grants, 10_000) == 10_000  # never above the server's own cap
    assert call_doc_limit([], 16 * 2**20) == ENVELOPE


def test_budget_refuses_what_does_not_fit() -> None:
    b = BodyBudget(100)
    b.take("t", 60)
    with pytest.raises(BodyLimit) as e:
        b.take("t", 41)
    assert (e.value.status, e.value.reason) == (429, "body_memory_limit")
    with pytest.raises(BodyLimit) as e:
        b.take("u", 101)  # can never fit
    assert (e.value.status, e.value.reason) == (413, "body_too_large")
    b.take("u", 100)  # another task's budget is its own
    b.give_back("t", 60)
    assert b.held == {"u": 100}
    with pytest.raises(ValueError):
        b.give_back("t", 1)


@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 150)), max_size=100))
def test_budget_never_exceeded(ops: list[tuple[str, int]]) -> None:
    b = BodyBudget(200)
    taken: dict[str, list[int]] = {"a": [], "b": []}
    for task, n in ops:
        if n % 3 == 0 and taken[task]:
            b.give_back(task, taken[task].pop())
            continue
        try:
            b.take(task, n)
            taken[task].append(n)
        except BodyLimit:
            pass
        assert all(v <= 200 for v in b.held.values())
        assert b.held.get(task, 0) == sum(taken[task])


# -- over real sockets -------------------------------------------------------------------------


@pytest.fixture
async def budgeted(
    tmp_path: Path, bao: DevOpenBao, upstream: Upstream, tls: tuple[ssl.SSLContext, str]
) -> AsyncIterator[Harness]:
    h, runner = await start_harness(tmp_path, bao, upstream, tls[1], settings={
        "max_body_bytes_in_flight_per_task": 96 * 1024})
    try:
        yield h
    finally:
        await stop_harness(h, runner)


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    return await asyncio.wait_for(read_response(reader), ANSWER_WINDOW_S)


@pytest.mark.vault
async def test_oversized_content_length_is_refused_before_the_body(harness: Harness) -> None:
    h = harness
    for expect in (b"Expect: 100-continue\r\n", b""):
        reader, writer = await open_conn(h)
        writer.write(HEAD + expect + b"Content-Length: %d\r\n\r\n" % (16 * 2**20))
        await writer.drain()
        # not a byte of the body was sent: the answer comes anyway, and no 100 Continue
        status, body = await _answer(reader)
        writer.close()
        assert (status, json.loads(body)["reason"]) == (413, "body_too_large")
    # a body within the limit still gets its 100 Continue and is served
    ok = json.dumps({"api": "echo", "path": "/json"}).encode()
    reader, writer = await open_conn(h)
    writer.write(HEAD + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(ok))
    await writer.drain()
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WINDOW_S)
    assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
    writer.write(ok)
    status, _body = await _answer(reader)
    writer.close()
    assert status == 200


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.mark.vault
async def test_chunked_body_over_the_limit_is_cut(harness: Harness) -> None:
    """The broker stops reading at limit + 1 and answers while the client is still in the
    middle of its body (it never sends the last chunk)."""
    reader, writer = await open_conn(harness)
    writer.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
    for _ in range(AGENT_LIMIT // 8192 + 2):
        writer.write(_chunk(b"x" * 8192))
    await writer.drain()
    status, body = await _answer(reader)
    writer.close()
    assert (status, json.loads(body)["reason"]) == (413, "body_too_large")


async def _hold_60k(h: Harness) -> asyncio.StreamWriter:
    """60 KiB of a chunked body held in memory (never finished), charged to task t1."""
    _held_r, held_w = await open_conn(h)
    held_w.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(b" " * 60 * 1024))
    await held_w.drain()
    for _ in range(200):
        if h.broker.bodies.held.get("t1", 0) >= 60 * 1024:
            break
        await asyncio.sleep(0.05)
    return held_w


async def _ask(h: Harness, raw: bytes) -> tuple[int, bytes]:
    """The answer to `raw`, sent on a connection of its own (closed afterwards)."""
    reader, writer = await open_conn(h)
    writer.write(raw)
    await writer.drain()
    status, body = await _answer(reader)
    writer.close()
    return status, body


async def _release(h: Harness, held_w: asyncio.StreamWriter) -> None:
    """The held call ends: its share comes back."""
    held_w.close()
    await async_wait_until(lambda: not h.broker.bodies.held)
    assert h.broker.bodies.held == {}


@pytest.mark.vault
async def test_a_tasks_bodies_share_one_budget(budgeted: Harness) -> None:
    h = budgeted
    held_w = await _hold_60k(h)
    status, body = await _ask(
        h, HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(b" " * 40 * 1024))
    assert (status, json.loads(body)["reason"]) == (429, "body_memory_limit")
    # a declared body that does not fit is refused before it is read
    status, body = await _ask(h, HEAD + b"Content-Length: 40000\r\n\r\n")
    assert (status, json.loads(body)["reason"]) == (429, "body_memory_limit")
    await _release(h, held_w)
    status, doc = await h.v1({"api": "echo", "path": "/json"})
    assert status == 200, doc
    reasons = [e["event"]["reason"] for e in h.event_list()
               if e["event"]["action"] == "broker_call"]
    assert reasons.count("body_memory_limit") == 2


@pytest.mark.vault
async def test_a_compressed_body_is_charged_as_it_grows(budgeted: Harness) -> None:
    """aiohttp inflates a gzip request body: its small Content-Length is not what it holds
    in memory, so the bytes read count against the task's budget too."""
    h = budgeted
    held_w = await _hold_60k(h)
    doc = json.dumps({"api": "echo", "path": "/json"}).encode() + b" " * 50 * 1024
    packed = gzip.compress(doc)
    assert len(packed) < 1024 and len(doc) < AGENT_LIMIT
    status, body = await _ask(
        h, HEAD + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed) + packed)
    assert (status, json.loads(body)["reason"]) == (429, "body_memory_limit")
    await _release(h, held_w)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _push(port: int, head: bytes, body: bytes, out: list[bytes], held: list[socket.socket],
          lock: threading.Lock) -> None:
    """Send a head and a body (all but its end) on a blocking socket, then hold it open."""
    s = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WINDOW_S)
    with lock:
        held.append(s)
    try:
        s.sendall(head)
        s.sendall(body)
    except OSError:
        pass  # the broker answered and closed while the body was still coming: expected
    try:
        got = s.recv(4096)
    except OSError:
        got = b""
    with lock:
        out.append(got)


@pytest.mark.vault
async def test_many_held_oversized_calls_do_not_grow_memory(harness: Harness) -> None:
    """32 calls of one task, each 8 MiB (declared, or chunked) held open before its end:
    the broker's RSS (this process: the broker runs in it) stays within a bound far below
    what buffering them would take (256 MiB)."""
    h = harness
    port = int(h.url.rsplit(":", 1)[1])
    size = 8 * 2**20
    declared = HEAD + b"Content-Length: %d\r\n\r\n" % size
    chunked = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    payload = b"x" * (size - 1)
    chunk_payload = _chunk(b"x" * (size - 64))
    out: list[bytes] = []
    held: list[socket.socket] = []
    lock = threading.Lock()
    before = _rss_bytes()
    threads = [threading.Thread(target=_push, daemon=True, args=(
        port, declared if i % 2 else chunked, payload if i % 2 else chunk_payload,
        out, held, lock)) for i in range(32)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            await asyncio.to_thread(t.join, ANSWER_WINDOW_S * 2)
        grown = _rss_bytes() - before
    finally:
        for s in held:
            s.close()
    assert len(out) == 32
    for got in out:
        assert_denial(got, 413, "body_too_large")
    assert grown < 64 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


@pytest.mark.vault
async def test_a_compressed_pass_through_body_is_forwarded_as_read(harness: Harness) -> None:
    """aiohttp inflated the body before the broker saw it: the upstream gets those bytes
    without a Content-Encoding that no longer describes them, and the grant's max_body
    (1 KiB) holds for what was inflated."""
    h = harness
    status, _h, body = await h.call("POST", "/echo/json", data=gzip.compress(b"q" * 900),
                                    headers={"Content-Encoding": "gzip"})
    assert status == 200, body
    (seen,) = h.upstream.seen
    assert seen["body"] == "q" * 900
    assert "content-encoding" not in {k.lower() for k, _v in seen["headers"]}
    status, _h, body = await h.call("POST", "/echo/json", data=gzip.compress(b"q" * 2000),
                                    headers={"Content-Encoding": "gzip"})
    assert (status, json.loads(body)["reason"]) == (413, "body_too_large")
    assert len(h.upstream.seen) == 1
