"""Gateway fixtures: a real gateway (in-process, own loop thread) in front of the fake
internet, and a client namespace whose TCP nftables redirects to it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gw_harness import GatewayHarness, gateway_config, registered_client, running_gateway
from gw_rules import write_rules

from stockade.testing.testnet import ClientNamespace, FakeInternet


@pytest.fixture(scope="module")
def gw(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHarness]:
    tmp = tmp_path_factory.mktemp("gw")
    rules = write_rules(tmp / "rules", cidr=fake_internet.subnet)
    cfg = gateway_config(
        tmp,
        fake_internet,
        rules,
        sniff_timeout_s=1.5,
        sniff_max_bytes=8192,
        rules_poll_interval_s=0.5,
        max_connections_per_task=8,
        dns={"ttl_min_s": 0},  # every connection re-resolves: rebinding is visible
        # these tests pin what happens without L7 inspection (fail closed); the inspector
        # has its own gateway in test_gw_inspection.py
        inspection={"enabled": False},
    )
    with running_gateway(cfg) as h:
        yield h


@pytest.fixture(scope="module")
def sandbox(gw: GatewayHarness) -> Iterator[ClientNamespace]:
    """A client namespace registered as task `t-web` (profile `web`)."""
    with registered_client(gw, "t-web", "web") as ns:
        yield ns


@pytest.fixture
def rules_dir(gw: GatewayHarness) -> Path:
    return Path(gw.config.rules_dir)
