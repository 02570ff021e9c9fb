"""Idle timeout and explicit-proxy raw TCP from loopback, on a gateway of its own."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from gw_harness import GatewayHarness, gateway_config, newest_event, running_gateway
from gw_rules import write_rules

from stockade.testing.testnet import FakeInternet

pytestmark = pytest.mark.netns


@pytest.fixture
def idle_gw(fake_internet: FakeInternet, tmp_path: Path) -> Iterator[GatewayHarness]:
    rules = write_rules(tmp_path / "rules", cidr=fake_internet.subnet)
    cfg = gateway_config(
        tmp_path,
        fake_internet,
        rules,
        transparent_listen=["127.0.0.1:0"],
        proxy_listen=["127.0.0.1:0"],
        idle_timeout_s=1.0,
    )
    with running_gateway(cfg) as h:
        h.register("t-idle", "127.0.0.1", "web")
        yield h


def test_idle_tunnel_is_closed(idle_gw: GatewayHarness, fake_internet: FakeInternet) -> None:
    echo_ip, echo_port = fake_internet.tcp_echo
    s = socket.create_connection(("127.0.0.1", idle_gw.port("proxy")), timeout=30)
    s.sendall(f"CONNECT {echo_ip}:{echo_port} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 200")
    s.sendall(b"hello")
    got = b""
    while len(got) < 5:
        got += s.recv(5)
    assert got == b"hello"
    assert s.recv(1) == b""  # nothing more is sent: the gateway closes the idle tunnel
    s.close()
    closes = [newest_event(idle_gw, "connection_close", 5)]
    assert closes[-1]["event"]["reason"] == "idle_timeout"
    assert closes[-1]["source"]["bytes"] == 5
    assert closes[-1]["destination"]["bytes"] == 5
