"""Pure parts of the listener guard and the in-flight cap: no sockets, no sleeping."""

from __future__ import annotations

import json

from aiohttp.http_exceptions import BadHttpMessage, InvalidHeader, LineTooLong
from hypothesis import given
from hypothesis import strategies as st
from stockade.broker.httpserver import classify_head_error, raw_denial
from stockade.broker.limits import InFlight

TASKS = st.sampled_from(["a", "b", "c"])


@given(limit=st.integers(1, 5), ops=st.lists(st.tuples(st.booleans(), TASKS), max_size=200))
def test_inflight_matches_a_counting_model(limit: int, ops: list[tuple[bool, str]]) -> None:
    """Any interleaving of acquires and releases: a slot is given iff the task holds fewer
    than `limit`, no task ever holds more, and tasks with nothing in flight leave no key."""
    inf = InFlight(limit)
    held: dict[str, int] = {}
    for acquire, task in ops:
        if acquire:
            ok = inf.acquire(task)
            assert ok == (held.get(task, 0) < limit)
            if ok:
                held[task] = held.get(task, 0) + 1
        elif held.get(task, 0):  # the broker only releases what it acquired
            inf.release(task)
            held[task] -= 1
        assert all(0 < n <= limit for n in inf.counts.values())
        assert inf.counts == {t: n for t, n in held.items() if n}
    for task, n in held.items():
        for _ in range(n):
            inf.release(task)
    assert inf.counts == {}


@given(st.text(max_size=300))
def test_head_errors_are_classified_without_quoting_the_caller(text: str) -> None:
    for exc in (LineTooLong(text.encode(), 8190), BadHttpMessage(text), InvalidHeader(text),
                BadHttpMessage("Too many headers received"), RuntimeError(text), None):
        status, reason, message = classify_head_error(400, exc)
        assert (status, reason) in {(431, "head_too_large"), (400, "bad_request"),
                                    (500, "internal_error")}
        assert message in {"request head too large", "malformed request", "internal error"}
    assert classify_head_error(400, LineTooLong(text.encode(), 1))[:2] == (431, "head_too_large")
    assert classify_head_error(400, BadHttpMessage("Too many headers received"))[0] == 431
    assert classify_head_error(400, InvalidHeader(text))[:2] == (400, "bad_request")


def test_the_callers_own_too_many_does_not_make_a_431() -> None:
    # hypothesis found it: an invalid header whose bytes say "too many" was a 431
    for text in ("TOO MANY", "x: too many headers received"):
        assert classify_head_error(400, InvalidHeader(text))[:2] == (400, "bad_request")
        assert classify_head_error(400, BadHttpMessage(text))[:2] == (400, "bad_request")
    assert classify_head_error(400, BadHttpMessage("Too many trailers received"))[0] == 431


def test_raw_denial_is_one_complete_response() -> None:
    raw = raw_denial(408, "request_timeout", "request head not received in time")
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 408 Request Timeout"
    fields = dict(line.split(b": ", 1) for line in lines[1:])
    assert int(fields[b"Content-Length"]) == len(body)
    assert fields[b"Connection"] == b"close" and fields[b"X-Stockade-Deny"] == b"request_timeout"
    assert json.loads(body) == {"error": "denied", "reason": "request_timeout",
                                "message": "request head not received in time"}
