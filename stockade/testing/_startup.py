"""The rigs' start-up rule: a start that fails half-way undoes itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def stop_on_failure(stop: Callable[[], None]) -> Iterator[None]:
    """Run `stop` and re-raise when the block fails, Ctrl-C included: a namespace, veth or
    server process a failed start made is never left behind for the next run to trip on."""
    try:
        yield
    except BaseException:
        stop()
        raise
