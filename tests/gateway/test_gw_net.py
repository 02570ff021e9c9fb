"""The gateway with real clients in a client namespace against the fake internet."""

from __future__ import annotations

import pytest
from gw_harness import GatewayHarness

from stockade.testnet import ClientNamespace, FakeInternet

pytestmark = pytest.mark.netns


def curl(ns: ClientNamespace, fi: FakeInternet, *args: str, timeout: int = 20):
    return ns.run(["curl", "-sS", "--max-time", "10", "--cacert", fi.ca_pem, *args],
                  capture_output=True, text=True, timeout=timeout)


def test_allowed_https_through_transparent(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(sandbox, fake_internet, *fake_internet.resolve_args("allowed.test"),
             "https://allowed.test/")
    assert r.returncode == 0, r.stderr
    assert "Hello from allowed.test" in r.stdout
    ev = gw.decisions("t-web")[-1]
    assert ev["stockade"]["decision"] == "allowed"
    assert ev["destination"]["domain"] == "allowed.test"
    assert ev["destination"]["ip"] == fake_internet.addresses["allowed.test"]
