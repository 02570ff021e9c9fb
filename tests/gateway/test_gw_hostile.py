"""Hostile first flights over real sockets, through both listeners: every connection is
refused and closed (none left hanging), none is ever allowed, every decision is an event
in the shared schema, and the gateway goes on serving."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from gw_harness import GatewayHarness
from polling import eventually
from test_gw_net import client, curl, ip

from stockade.testing.testnet import ClientNamespace, FakeInternet

pytestmark = pytest.mark.netns

COUNT = 45  # five of each kind (gw_client._hostile_payloads)


@pytest.mark.parametrize("listener", ["transparent", "proxy"])
def test_hostile_first_flights_are_refused_and_closed(
    gw: GatewayHarness,
    sandbox: ClientNamespace,
    fake_internet: FakeInternet,
    listener: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = (
        (ip(fake_internet, "allowed.test"), 443)  # redirected by nft to the gateway
        if listener == "transparent"
        else (sandbox.host_ip, gw.port("proxy"))
    )
    n0 = len(gw.events())  # only what this test's connections write counts below
    with caplog.at_level(logging.ERROR, logger="stockade.gateway"):
        out = client(
            sandbox, "hostile", target[0], str(target[1]), "7413", str(COUNT), timeout=300
        )
    assert not caplog.records, caplog.text  # no "unexpected error" in the gateway
    results = out["results"]
    assert len(results) == COUNT
    hanging = [r for r in results if not r["closed"]]
    assert not hanging, hanging  # each closed by the gateway, not by the client's timeout
    for r in results:
        # an HTTP answer is only ever the gateway's 403 (never an upstream's bytes)
        if bytes.fromhex(r["reply"]).startswith(b"HTTP/"):
            assert bytes.fromhex(r["reply"]).startswith(b"HTTP/1.1 403"), r
    # every hostile connection has its decision event, a denial (matched by source port)
    ports = {r["port"] for r in results}

    def all_mine() -> list[dict[str, Any]]:  # once there is a decision for every port
        evs = [
            e
            for e in gw.events()[n0:]
            if e["event"]["action"] == "connection_decision" and e["source"]["port"] in ports
        ]
        return evs if {e["source"]["port"] for e in evs} == ports else []

    mine = eventually(all_mine, 5, 0.1)  # events are written a moment after the decision
    assert {e["source"]["port"] for e in mine} == ports
    assert {e["stockade"]["decision"] for e in mine} == {"denied"}, [
        e for e in mine if e["stockade"]["decision"] != "denied"
    ]
    assert not [e for e in gw.events()[n0:] if e["event"].get("reason") == "internal_error"]
    # and the gateway still serves an allowed flow
    r = curl(
        sandbox, fake_internet, *fake_internet.resolve_args("allowed.test"), "https://allowed.test/"
    )
    assert r.returncode == 0, r.stderr
    assert "Hello from allowed.test" in r.stdout
