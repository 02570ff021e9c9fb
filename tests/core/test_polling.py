"""tests/polling.py: the first truthy value, or an AssertionError that says what was
awaited once the timeout has passed."""

import pytest
from polling import async_wait_until, eventually, wait_until


def _truthy_on(n: int):
    calls = []

    def pred():
        calls.append(1)
        return len(calls) if len(calls) >= n else 0

    return pred


def test_returns_the_first_truthy_value():
    assert wait_until(_truthy_on(3), interval=0) == 3


def test_times_out_with_what_and_the_last_value():
    with pytest.raises(AssertionError, match=r"the thing \(last value: \[\]\)"):
        wait_until(lambda: [], timeout=0, what="the thing")


def test_what_may_be_asked_at_the_timeout():
    state = {"why": "starting"}

    def pred():
        state["why"] = "still starting"
        return False

    with pytest.raises(AssertionError, match="still starting"):
        wait_until(pred, timeout=0, what=lambda: state["why"])


async def test_async_takes_plain_and_async_predicates():
    async def ready():
        return "yes"

    assert await async_wait_until(ready) == "yes"
    assert await async_wait_until(_truthy_on(2), interval=0) == 2
    with pytest.raises(AssertionError, match="never"):
        await async_wait_until(lambda: None, timeout=0, what="never")


def test_eventually_leaves_the_assertion_to_the_caller():
    assert eventually(_truthy_on(2), interval=0) == 2
    assert eventually(lambda: 0, timeout=0) == 0
