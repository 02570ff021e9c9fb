from __future__ import annotations

from collections.abc import Iterator

import pytest
from dns_upstream import Upstream


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with Upstream() as up:
        yield up
