"""Fixtures of the orchestrator-side end-to-end tests (SDK, MCP server, examples)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sessions_stack import Stack, stack_up


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, fake_internet) -> Iterator[Stack]:
    """A whole stack (`stockade up`) per test module, torn down after its last test."""
    with stack_up(tmp_path_factory.mktemp("stack"), fake_internet) as s:
        yield s
