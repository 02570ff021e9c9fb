"""Fixtures of the orchestrator-side end-to-end tests (SDK, MCP server, examples)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sessions_stack import Stack, stack_up


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          fake_internet) -> Iterator[Stack]:
    """A whole stack (`stockade up`) per test module, torn down after its last test; a
    module's `stack_settings(root)` adds stockade.yaml sections (files it writes under
    root, such as a token file)."""
    root = tmp_path_factory.mktemp("stack")
    settings = getattr(request.module, "stack_settings", lambda _root: {})(root)
    with stack_up(root, fake_internet, **settings) as s:
        yield s
