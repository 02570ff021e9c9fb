"""Name tunnelling through the TCP path: SNI, CONNECT authorities under an allowed
wildcard make the gateway resolve names a sandbox chose, so the DNS firewall's
tunnelling guards apply to them too, with one per-task budget shared with DNS.

A real gateway with its DNS firewall, a client namespace whose TCP and port-53 traffic
nftables redirect to it, and the fake internet (every `*.tunnel.test` is NXDOMAIN).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_harness import GatewayHarness, write_config

from stockade.ports import free_dual_port
from stockade.testnet import ClientNamespace, FakeInternet

pytestmark = pytest.mark.netns

CLIENT = str(Path(__file__).with_name("gw_client.py"))

PROFILE = """\
profile: names
description: name-tunnelling guards on the TCP path
egress:
  allow:
    - host: allowed.test
      ports: [443]
      reason: the test upstream
    - host: "*.tunnel.test"
      ports: [443]
      reason: a wildcard whose subdomains answer NXDOMAIN
"""

ENTROPY_LABEL = "q7x2m9k4v8z1n6b3w5c0"  # 20 distinct characters: 4.3 bits/char
BUDGET = 4


@pytest.fixture(scope="module")
def gwd(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHarness]:
    tmp = tmp_path_factory.mktemp("gwnames")
    rules = tmp / "rules"
    (rules / "profiles").mkdir(parents=True)
    (rules / "profiles" / "names.yaml").write_text(PROFILE)
    cfg = write_config(
        tmp,
        rules,
        transparent_listen=["0.0.0.0:0"],
        proxy_listen=["0.0.0.0:0"],
        resolvers=[fake_internet.dns_server],
        allow_addresses=[fake_internet.subnet],
        sniff_timeout_s=1.5,
        dns={
            "listen": [f"0.0.0.0:{free_dual_port()}"],
            "unresolvable_names_per_minute": BUDGET,
            "max_label_length": 40,
            "max_name_length": 120,
        },
    )
    h = GatewayHarness(cfg).start(dns=True)
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def ns(gwd: GatewayHarness) -> Iterator[ClientNamespace]:
    assert gwd.svc is not None and gwd.svc.dns is not None
    dns_port = gwd.svc.dns.addresses[0][1]
    n = ClientNamespace(
        name_suffix=f"gwn{secrets.token_hex(3)}",
        redirect_tcp_port=gwd.port("transparent"),
        redirect_dns_port=dns_port,
        exempt_tcp_ports=(gwd.port("proxy"),),
    )
    n.start()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
def task(gwd: GatewayHarness, ns: ClientNamespace) -> Iterator[str]:
    """A fresh task on the namespace's address: a fresh guard budget per test."""
    tid = f"t-names-{secrets.token_hex(3)}"
    gwd.register(tid, ns.address, "names")
    try:
        yield tid
    finally:
        gwd.control.deregister(tid)


def client(n: ClientNamespace, *args: str) -> dict[str, Any]:
    r = n.run([sys.executable, CLIENT, *args], capture_output=True, text=True, timeout=40)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def tls(n: ClientNamespace, fi: FakeInternet, sni: str) -> dict[str, Any]:
    """A TLS connection from the sandbox to allowed.test's address with this SNI."""
    return client(n, "tls", fi.addresses["allowed.test"], "443", sni, "-")


def dig(n: ClientNamespace, name: str) -> str:
    """The DNS status the sandbox gets for `name` (port 53 is redirected to the firewall)."""
    r: subprocess.CompletedProcess[str] = n.run(
        ["dig", "+tries=1", "+time=3", f"@{n.host_ip}", name, "A"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    for word in r.stdout.split():
        if word.rstrip(",") in ("NOERROR", "NXDOMAIN", "REFUSED", "SERVFAIL"):
            return word.rstrip(",")
    raise AssertionError(r.stdout)


def event(gw: GatewayHarness, task: str, action: str, name: str) -> dict[str, Any]:
    """The newest event of `task` for `name` (events of allowed flows are batched)."""
    for _ in range(50):
        for ev in reversed(gw.events()):  # validated against the schema
            if (
                ev["event"]["action"] == action
                and ev.get("labels", {}).get("task_id") == task
                and ev.get("destination", {}).get("domain") == name
            ):
                return ev
        time.sleep(0.1)
    raise AssertionError(f"no {action} event of {task} for {name}")


def resolved(gw: GatewayHarness, name: str) -> bool:
    assert gw.svc is not None
    return gw.svc.resolver.cached(name) is not None


def test_high_entropy_sni_under_allowed_wildcard_is_denied(
    gwd: GatewayHarness, ns: ClientNamespace, fake_internet: FakeInternet, task: str
) -> None:
    name = f"{ENTROPY_LABEL}.tunnel.test"
    out = tls(ns, fake_internet, name)
    assert "error" in out and "response" not in out  # a TLS alert, never a hang
    ev = event(gwd, task, "connection_decision", name)
    assert ev["stockade"]["decision"] == "denied"
    assert ev["event"]["reason"] == "high_entropy_label"
    assert ev["stockade"]["component"] == "gateway"
    assert ev["rule"]["id"]  # the wildcard entry the name fell under
    assert not resolved(gwd, name)  # the name never reached the upstream resolver
    # the same name through DNS is refused for the same reason
    assert dig(ns, name) == "REFUSED"
    assert event(gwd, task, "dns_decision", name)["event"]["reason"] == "high_entropy_label"


def test_high_entropy_connect_authority_gets_403(
    gwd: GatewayHarness, ns: ClientNamespace, task: str
) -> None:
    name = f"{ENTROPY_LABEL[::-1]}.tunnel.test"
    out = client(ns, "connect-tls", ns.host_ip, str(gwd.port("proxy")), f"{name}:443", name)
    assert " 403 " in str(out["connect"]) + " "
    assert "high_entropy_label" in str(out["body"])
    ev = event(gwd, task, "connection_decision", name)
    assert ev["event"]["reason"] == "high_entropy_label"
    assert ev["stockade"]["listener"] == "proxy"
    assert not resolved(gwd, name)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("a" * 45 + ".tunnel.test", "label_too_long"),
        (".".join(["abcdefghijklmnopqrstuvwxyz"] * 5) + ".tunnel.test", "name_too_long"),
    ],
)
def test_long_names_in_sni_are_denied(
    gwd: GatewayHarness,
    ns: ClientNamespace,
    fake_internet: FakeInternet,
    task: str,
    name: str,
    reason: str,
) -> None:
    out = tls(ns, fake_internet, name)
    assert "error" in out and "response" not in out
    ev = event(gwd, task, "connection_decision", name)
    assert ev["event"]["reason"] == reason
    assert not resolved(gwd, name)


def test_dns_queries_use_up_the_tcp_budget(
    gwd: GatewayHarness, ns: ClientNamespace, fake_internet: FakeInternet, task: str
) -> None:
    """Distinct NXDOMAIN names asked over DNS exhaust the budget a new SNI draws from."""
    tag = secrets.token_hex(2)
    asked = [f"d{tag}{i}.tunnel.test" for i in range(BUDGET)]
    assert [dig(ns, n) for n in asked] == ["NXDOMAIN"] * BUDGET
    fresh = f"d{tag}x.tunnel.test"
    out = tls(ns, fake_internet, fresh)
    assert "error" in out and "response" not in out
    ev = event(gwd, task, "connection_decision", fresh)
    assert ev["stockade"]["decision"] == "denied"
    assert ev["event"]["reason"] == "unresolvable_name_budget"
    assert not resolved(gwd, fresh)
    # a name already counted is not refused by the budget (it fails to resolve instead)
    tls(ns, fake_internet, asked[0])
    assert event(gwd, task, "connection_decision", asked[0])["event"]["reason"] == (
        "resolve_failed"
    )
    # other allow entries are unaffected
    assert "Hello from allowed.test" in str(tls(ns, fake_internet, "allowed.test")["response"])


def test_tcp_names_use_up_the_dns_budget(
    gwd: GatewayHarness, ns: ClientNamespace, fake_internet: FakeInternet, task: str
) -> None:
    """Distinct unresolvable SNIs exhaust the budget the DNS firewall then enforces."""
    tag = secrets.token_hex(2)
    for i in range(BUDGET):
        name = f"s{tag}{i}.tunnel.test"
        tls(ns, fake_internet, name)
        assert event(gwd, task, "connection_decision", name)["event"]["reason"] == (
            "resolve_failed"
        )
    fresh = f"s{tag}x.tunnel.test"
    assert dig(ns, fresh) == "REFUSED"
    ev = event(gwd, task, "dns_decision", fresh)
    assert ev["event"]["reason"] == "unresolvable_name_budget"
    assert ev["stockade"]["component"] == "dns"
