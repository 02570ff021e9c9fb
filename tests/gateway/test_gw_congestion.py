"""The sandbox side's TCP congestion control (`gateway.sandbox_congestion_control`): set
on every listener, inherited by each accepted connection; an unknown algorithm is
reported and leaves the system default, and the gateway still serves."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_harness import GatewayHarness, write_config
from gw_rules import write_rules
from polling import eventually


def _cc(sock: socket.socket) -> str:
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    return raw.split(b"\0", 1)[0].decode()


def _system_default() -> str:
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


@pytest.fixture
def start_gw(tmp_path: Path) -> Iterator[Any]:
    started: list[GatewayHarness] = []

    def start(**gateway: Any) -> GatewayHarness:
        cfg = write_config(
            tmp_path,
            write_rules(tmp_path / "rules"),
            transparent_listen=["127.0.0.1:0"],
            proxy_listen=["127.0.0.1:0"],
            **gateway,
        )
        h = GatewayHarness(cfg).start()
        started.append(h)
        return h

    yield start
    for h in started:
        h.stop()


def _accepted_cc(h: GatewayHarness) -> str:
    """The congestion control of a connection the transparent listener accepted (which
    also inherits TCP_NODELAY from it: the gateway sets neither per connection)."""
    with socket.create_connection(("127.0.0.1", h.port("transparent")), timeout=5):
        opts = eventually(lambda: h.run(_first_conn_options(h)), 5, 0.01)
        assert opts is not None, "the gateway did not accept the connection"
        nodelay, cc = opts
        assert nodelay == 1
        return cc


async def _first_conn_options(h: GatewayHarness) -> tuple[int, str] | None:
    """TCP_NODELAY and the congestion control of a tracked connection, read on the
    gateway's loop thread (which owns the set and the sockets)."""
    assert h.svc is not None
    for conn in h.svc.gateway.conns:
        return conn.client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), _cc(conn.client)
    return None


def test_listeners_and_accepted_sockets_use_the_configured_algorithm(start_gw: Any) -> None:
    h = start_gw()  # the default: cubic (built into Debian's kernels)
    assert h.config.gateway.sandbox_congestion_control == "cubic"
    assert h.svc is not None
    assert {_cc(lst.sock) for lst in h.svc.gateway._servers} == {"cubic"}
    assert _accepted_cc(h) == "cubic"


def test_none_keeps_the_system_default(start_gw: Any) -> None:
    h = start_gw(sandbox_congestion_control=None)
    assert _accepted_cc(h) == _system_default()


def test_an_unavailable_algorithm_is_reported_and_the_gateway_serves(
    start_gw: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="stockade.gateway"):
        h = start_gw(sandbox_congestion_control="nosuchcc")
    assert "sandbox_congestion_control 'nosuchcc' unavailable" in caplog.text
    assert _accepted_cc(h) == _system_default()


@pytest.mark.parametrize("bad", ["", "BBR", "cubic; rm", "x" * 16])
def test_a_malformed_name_is_refused_at_config_load(tmp_path: Path, bad: str) -> None:
    from stockade.config import ConfigError, load_config

    cfg = write_config(tmp_path, tmp_path / "rules", sandbox_congestion_control=bad)
    with pytest.raises(ConfigError, match="sandbox_congestion_control"):
        load_config(cfg)
