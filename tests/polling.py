"""Waiting for a condition instead of sleeping a fixed time: on a busy machine a fixed
sleep is either too short (a flaky test) or too long (a slow one)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
Why = str | Callable[[], str]  # what was awaited; a callable is asked at the timeout


def eventually(pred: Callable[[], T], timeout: float = 10.0, interval: float = 0.05) -> T:
    """`pred()`'s first truthy value, asked every `interval` s, or its last (falsy) one
    once `timeout` s have passed: for an assertion with a message of its own,
    `assert eventually(...), context`."""
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got or time.monotonic() >= end:
            return got
        time.sleep(interval)


def wait_until(
    pred: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: Why = ""
) -> T:
    """`eventually`, raising AssertionError (naming `what`, else the predicate, and its
    last value) on the timeout."""
    got = eventually(pred, timeout, interval)
    if not got:
        raise AssertionError(_message(pred, what, timeout, got))
    return got


async def async_wait_until(
    pred: Callable[[], T | Awaitable[T]], timeout: float = 10.0, interval: float = 0.05,
    what: Why = "",
) -> T:
    """`wait_until` on an event loop: `pred` may be a plain or an async function."""
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if isinstance(got, Awaitable):
            got = await got
        if got:
            return got  # type: ignore[return-value]
        if time.monotonic() >= end:
            raise AssertionError(_message(pred, what, timeout, got))
        await asyncio.sleep(interval)


def _message(pred: Callable[..., object], what: Why, timeout: float, got: object) -> str:
    name = (what() if callable(what) else what) or getattr(pred, "__qualname__", repr(pred))
    return f"not true after {timeout} s: {name} (last value: {got!r})"
