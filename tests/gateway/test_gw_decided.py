"""Every connection a task makes is one decision in its evidence, however it ends: still
in the gateway's listen queue when the task ends, or refused over the task's connection
limit while its first bytes were awaited. A real gateway (conftest) and real clients in a
client namespace whose TCP nftables redirects to it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_harness import GatewayHarness, client_namespace, newest_event
from polling import wait_until

from stockade.testing.testnet import ClientNamespace, FakeInternet

pytestmark = pytest.mark.netns

CLIENT = str(Path(__file__).with_name("gw_client.py"))


@pytest.fixture
def fresh_ns(gw: GatewayHarness) -> Iterator[ClientNamespace]:
    ns = client_namespace(gw, "dc")
    try:
        yield ns
    finally:
        ns.stop()


def _decisions(gw: GatewayHarness, task: str) -> list[dict[str, Any]]:
    return [e for e in gw.events() if e["event"]["action"] == "connection_decision"
            and e.get("labels", {}).get("task_id") == task]


def _popen(ns: ClientNamespace, *args: str) -> subprocess.Popen[str]:
    """A gw_client command in `ns`, once it printed that it is connected."""
    p = ns.popen([sys.executable, CLIENT, *args], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert json.loads(p.stdout.readline())["ready"]
    return p


def _closed(p: subprocess.Popen[str]) -> bool:
    assert p.stdout is not None
    out = json.loads(p.stdout.readline())
    p.wait(timeout=30)
    return bool(out["closed"])


@contextlib.contextmanager
def not_accepting(gw: GatewayHarness) -> Iterator[None]:
    """The gateway's listeners accept nothing meanwhile: a new connection's handshake is
    completed by the kernel and it waits in the listen queue (as in a burst's backlog)."""
    assert gw.svc is not None
    listening = gw.svc.gateway._servers  # the harness's in-process gateway

    async def pause() -> None:
        for each in listening:
            each.pause(600)

    async def resume() -> None:
        for each in listening:
            each.resume()

    gw.run(pause())
    try:
        yield
    finally:
        gw.run(resume())


def test_a_connection_still_queued_at_its_tasks_end_is_decided(
    gw: GatewayHarness, fresh_ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    # once the task is gone its address is unknown: accepted later, the connection
    # would be an unlabelled unknown_task, outside the task's evidence
    gw.register("t-queued", fresh_ns.address, "web")
    with not_accepting(gw):
        p = _popen(fresh_ns, "mute", fake_internet.addresses["allowed.test"], "443")
        gw.control.deregister("t-queued")
        assert _closed(p)  # while the listeners still accept nothing: the task's end did
    ev = newest_event(gw, "connection_decision", 5, labels__task_id="t-queued")
    assert ev["event"]["reason"] == "task_ended"
    assert ev["stockade"]["decision"] == "denied"
    assert ev["destination"]["port"] == 443  # its original destination, read at the end
    assert len(_decisions(gw, "t-queued")) == 1


def test_a_connection_over_the_limit_is_cut_short_by_its_tasks_end(
    gw: GatewayHarness, fresh_ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    # refused over the limit, a silent connection waits for its first bytes (to be told
    # in its own protocol); the task's end closes it as it does the task's admitted ones
    limit = gw.config.gateway.max_connections_per_task
    site = fake_internet.addresses["allowed.test"]
    gw.register("t-over", fresh_ns.address, "web")
    try:
        holders = [_popen(fresh_ns, "hold", site, "443", "allowed.test") for _ in range(limit)]
        over = _popen(fresh_ns, "mute", site, "443")
        time.sleep(0.2)  # accepted and refused by the gateway (far inside the sniff timeout)
    finally:
        gw.control.deregister("t-over")
    assert _closed(over)
    assert all(_closed(p) for p in holders)

    def all_decided() -> list[dict[str, Any]]:
        got = _decisions(gw, "t-over")
        return got if len(got) > limit else []

    got = wait_until(all_decided, 10, 0.1, what="a decision for every connection of t-over")
    outcomes = Counter((e["stockade"]["decision"], e["event"]["reason"]) for e in got)
    assert outcomes == {("allowed", "allowed_by_rule"): limit, ("denied", "task_ended"): 1}
