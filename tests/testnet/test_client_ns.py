"""ClientNamespace: redirected TCP and DNS, exemptions, rejection of the rest, cleanup."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stockade.testing.testnet import ClientNamespace, FakeInternet

from .relay import Relay, running_relay

pytestmark = pytest.mark.netns

MakeClient = Callable[..., ClientNamespace]


@pytest.fixture
def relay(fake_internet: FakeInternet) -> Iterator[Relay]:
    with running_relay(fake_internet.subnet, fake_internet.dns_server) as r:
        yield r


def py(client: ClientNamespace, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return client.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                      timeout=60)


def test_wiring(client_ns: MakeClient, relay: Relay) -> None:
    c = client_ns(redirect_tcp_port=relay.tcp_port, redirect_dns_port=relay.dns_port)
    assert c.address.startswith("10.251.") and c.network.endswith("/30")
    table = subprocess.run(["nft", "-j", "list", "table", "inet", c.nft_table],
                           capture_output=True, text=True, check=True)
    chains = {o["chain"]["name"] for o in json.loads(table.stdout)["nftables"] if "chain" in o}
    assert chains == {"prerouting", "input", "forward"}
    route = c.run(["ip", "-j", "route"], capture_output=True, text=True, check=True)
    default = [r for r in json.loads(route.stdout) if r["dst"] == "default"]
    assert [r["gateway"] for r in default] == [c.host_ip]


@pytest.mark.parametrize("transport", ["udp", "tcp"])
@pytest.mark.parametrize("server", ["dns_server", "unused"])
def test_dns_to_any_server_is_redirected(
    fake_internet: FakeInternet, client_ns: MakeClient, relay: Relay, server: str, transport: str
) -> None:
    c = client_ns(redirect_tcp_port=relay.tcp_port, redirect_dns_port=relay.dns_port)
    code = (
        "import sys, dns.resolver\n"
        "r = dns.resolver.Resolver(configure=False)\n"
        "r.nameservers = [sys.argv[1]]\n"
        "r.lifetime = 10\n"
        "ans = r.resolve('cname.test', 'A', tcp=sys.argv[2] == 'tcp')\n"
        "print(ans[0].to_text())\n"
    )
    # an address nothing listens on can only be answered through the redirect
    unused = fake_internet.host_ip.rsplit(".", 1)[0] + ".99"
    target = fake_internet.dns_server if server == "dns_server" else unused
    out = py(c, code, target, transport)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == fake_internet.addresses["allowed.test"]
    kind = "dns" if transport == "udp" else "dns-tcp"
    assert any(k == kind for k, _ in relay.seen)
    assert not [d for k, d in relay.seen if k == "tcp"]


def test_https_through_the_redirect(
    fake_internet: FakeInternet, client_ns: MakeClient, relay: Relay
) -> None:
    fi = fake_internet
    c = client_ns(redirect_tcp_port=relay.tcp_port, redirect_dns_port=relay.dns_port)
    out = c.run(["curl", "-sS", "--max-time", "20", "--cacert", fi.ca_pem,
                 "https://api.test/v1/whoami", "-H", f"Authorization: Bearer {fi.api_key}"],
                capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"user": "demo"}
    assert ("tcp", (fi.addresses["api.test"], 443)) in relay.seen


@pytest.mark.slow
def test_pip_install_through_the_redirect(
    fake_internet: FakeInternet, client_ns: MakeClient, relay: Relay, tmp_path: Path
) -> None:
    fi = fake_internet
    c = client_ns(redirect_tcp_port=relay.tcp_port, redirect_dns_port=relay.dns_port)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null"}
    target = tmp_path / "site"
    out = c.run(
        [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
         "--index-url", "https://pypi.test/simple", "--cert", fi.ca_pem,
         "--target", str(target), "stockade-demo-pkg"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    imported = subprocess.run(
        [sys.executable, "-c", "import stockade_demo_pkg as m; print(m.hello())"],
        env={"PYTHONPATH": str(target)}, capture_output=True, text=True, check=True,
    )
    assert imported.stdout.strip() == "hello from stockade-demo-pkg 1.0"


def test_udp_other_than_dns_is_rejected(fake_internet: FakeInternet, client_ns: MakeClient,
                                        relay: Relay) -> None:
    c = client_ns(redirect_tcp_port=relay.tcp_port, redirect_dns_port=relay.dns_port)
    ip, port = fake_internet.udp_echo
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "s.settimeout(5)\n"
        "s.connect((sys.argv[1], int(sys.argv[2])))\n"
        "s.send(b'x')\n"
        "try:\n"
        "    print('GOT', s.recv(10))\n"
        "except OSError as e:\n"
        "    print('ERR', type(e).__name__)\n"
    )
    out = py(c, code, ip, str(port))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR"), out.stdout


def test_icmp_is_rejected(fake_internet: FakeInternet, client_ns: MakeClient,
                          relay: Relay) -> None:
    c = client_ns(redirect_tcp_port=relay.tcp_port, redirect_dns_port=relay.dns_port)
    out = c.run(["ping", "-c", "1", "-W", "3", fake_internet.addresses["allowed.test"]],
                capture_output=True, text=True, timeout=30)
    assert out.returncode != 0


def test_exempt_port_reaches_the_host_unredirected(client_ns: MakeClient, relay: Relay) -> None:
    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]
    c = client_ns(redirect_tcp_port=relay.tcp_port, redirect_dns_port=relay.dns_port,
                  exempt_tcp_ports=(port,))
    got: list[tuple[str, int]] = []

    def accept() -> None:
        conn, _ = listener.accept()
        with conn:
            got.append(conn.getsockname())
            conn.sendall(b"direct\n")

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    out = c.run(["curl", "-sS", "--max-time", "10", f"telnet://{c.host_ip}:{port}"],
                capture_output=True, text=True, timeout=30)
    t.join(10)
    listener.close()
    assert out.stdout == "direct\n"
    assert got == [(c.host_ip, port)]
    assert not [d for kind, d in relay.seen if kind == "tcp"]


def test_given_address_is_used(client_ns: MakeClient, relay: Relay) -> None:
    # a /30 high in the client space, unlikely to be taken by auto-allocation
    c = client_ns(address="10.251.250.6", redirect_tcp_port=relay.tcp_port,
                  redirect_dns_port=relay.dns_port)
    assert (c.address, c.host_ip, c.network) == ("10.251.250.6", "10.251.250.5",
                                                  "10.251.250.4/30")


def test_a_new_client_on_an_old_address_gets_its_own_redirect(client_ns: MakeClient) -> None:
    """conntrack entries outlive a namespace, NAT mapping included: a datagram from a
    reused (address, source port) must reach the new client's DNS port, not the old one
    (that lost 1 in a few hundred queries of back-to-back DNS tests)."""
    send = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('0.0.0.0', 40053))\n"
        "s.sendto(sys.argv[2].encode(), (sys.argv[1], 53))\n"
    )
    got = []
    for i in range(2):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
            listener.bind(("0.0.0.0", 0))
            listener.settimeout(5)
            port = listener.getsockname()[1]
            c = client_ns(address="10.251.250.10", redirect_tcp_port=1,
                          redirect_dns_port=port)  # fmt: skip
            out = py(c, send, c.host_ip, f"query{i}")
            assert out.returncode == 0, out.stderr
            data, _ = listener.recvfrom(100)
            got.append(data)
            c.stop()
    assert got == [b"query0", b"query1"]
