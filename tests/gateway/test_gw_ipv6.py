"""IPv6 transparent path: a v6-only client namespace whose TCP nftables (ip6) redirects to
a dual-stack gateway listener; the original destination comes from IP6T_SO_ORIGINAL_DST
and the gateway still dials the checked address it resolved."""

from __future__ import annotations

import ipaddress
import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from gw_harness import GatewayHarness, gateway_config, newest_event
from gw_rules import write_rules

from stockade.testing.testnet import FakeInternet

pytestmark = pytest.mark.netns


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=30)


class V6Client:
    """A namespace with only an IPv6 ULA link to the host (names carry a random suffix)."""

    def __init__(self, redirect_port: int) -> None:
        tag = secrets.token_hex(3)
        self.ns = f"skgw6-{tag}"
        self.host_if = f"sk6h{tag}"
        self.table = f"stockade_g6_{tag}"
        prefix = f"fd77:{secrets.token_hex(2)}:{secrets.token_hex(2)}:1"
        # canonical text (a random group like 01ee is written 1ee), as events carry it
        self.host_ip = str(ipaddress.IPv6Address(f"{prefix}::1"))
        self.address = str(ipaddress.IPv6Address(f"{prefix}::2"))
        # what the client dials: the host end of our own veth (redirected to the gateway)
        self.far_ip = self.host_ip
        self.port = redirect_port

    def start(self) -> V6Client:
        try:
            sh("ip", "netns", "add", self.ns)
            sh(
                "ip",
                "link",
                "add",
                self.host_if,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                self.ns,
            )
            sh("ip", "addr", "add", f"{self.host_ip}/64", "dev", self.host_if, "nodad")
            sh("ip", "link", "set", self.host_if, "up")
            sh("ip", "-n", self.ns, "addr", "add", f"{self.address}/64", "dev", "eth0", "nodad")
            sh("ip", "-n", self.ns, "link", "set", "eth0", "up")
            sh("ip", "-n", self.ns, "link", "set", "lo", "up")
            sh("ip", "-n", self.ns, "-6", "route", "add", "default", "via", self.host_ip)
            rules = (
                f"table inet {self.table} {{\n"
                "  chain prerouting {\n"
                "    type nat hook prerouting priority dstnat; policy accept;\n"
                f'    iifname "{self.host_if}" meta l4proto tcp redirect to :{self.port}\n'
                "  }\n}\n"
            )
            subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True, timeout=30)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        sh("nft", "delete", "table", "inet", self.table, check=False)
        sh("ip", "link", "del", self.host_if, check=False)
        sh("ip", "netns", "del", self.ns, check=False)

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True, timeout=40
        )


@pytest.fixture
def v6(fake_internet: FakeInternet, tmp_path: Path) -> Iterator[tuple[GatewayHarness, V6Client]]:
    rules = write_rules(tmp_path / "rules", cidr=fake_internet.subnet)
    cfg = gateway_config(
        tmp_path,
        fake_internet,
        rules,
        transparent_listen=["[::]:0"],  # dual-stack
        proxy_listen=["127.0.0.1:0"],
    )
    gw = GatewayHarness(cfg).start()
    client = V6Client(gw.port("transparent"))
    try:
        client.start()
        gw.register("t-v6", client.address, "web")
        yield gw, client
    finally:
        client.stop()
        gw.stop()


def test_ipv6_transparent_uses_checked_address(
    v6: tuple[GatewayHarness, V6Client], fake_internet: FakeInternet
) -> None:
    gw, client = v6
    r = client.run(
        "curl",
        "-sS",
        "--max-time",
        "15",
        "--cacert",
        fake_internet.ca_pem,
        "--resolve",
        f"allowed.test:443:[{client.far_ip}]",
        "https://allowed.test/",
    )
    assert r.returncode == 0, r.stderr
    assert "Hello from allowed.test" in r.stdout
    ev = newest_event(gw, "connection_decision", 5, labels__task_id="t-v6")
    assert ev["source"]["ip"] == client.address
    assert ev["stockade"]["original_destination"] == f"{client.far_ip}:443"
    assert ev["destination"]["ip"] == fake_internet.addresses["allowed.test"]
    assert json.dumps(ev)  # serialisable, validated by gw.decisions()


def test_ipv6_literal_sni_is_denied(
    v6: tuple[GatewayHarness, V6Client], fake_internet: FakeInternet
) -> None:
    gw, client = v6
    r = client.run("curl", "-sS", "-k", "--max-time", "15", f"https://[{client.far_ip}]/")
    assert r.returncode != 0
    evs = [newest_event(gw, "connection_decision", 5, labels__task_id="t-v6")]
    assert evs[-1]["stockade"]["decision"] == "denied"
