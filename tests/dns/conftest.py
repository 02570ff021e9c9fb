from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from dns_harness import PROFILE, REPORT, Harness, loopback, start_harness  # noqa: F401
from dns_upstream import Upstream
from stockade.policy.loader import load_rules
from stockade.policy.ruleset import RuleSet


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with Upstream() as up:
        yield up


@pytest.fixture(scope="session")
def ruleset(tmp_path_factory: pytest.TempPathFactory) -> RuleSet:
    root: Path = tmp_path_factory.mktemp("dnsrules")
    for d in ("profiles", "apis", "presets", "tests"):
        (root / d).mkdir()
    (root / "profiles" / "dns-test.yaml").write_text(PROFILE)
    (root / "profiles" / "dns-report.yaml").write_text(REPORT)
    return load_rules(root)


@pytest.fixture
async def harness(upstream: Upstream, ruleset: RuleSet) -> AsyncIterator[Harness]:
    h = await start_harness(upstream, ruleset)
    try:
        yield h
    finally:
        await h.fw.stop()
