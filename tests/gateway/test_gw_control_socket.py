"""A gateway that stops cleanly removes its control socket file, but only its own: a
socket another instance has bound at the same path since is left alone."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from gw_harness import GatewayHarness, write_config
from gw_rules import write_rules


def _gateway(tmp_path: Path) -> GatewayHarness:
    rules = write_rules(tmp_path / "rules", cidr="10.250.0.0/24")
    cfg = write_config(
        tmp_path, rules, transparent_listen=["127.0.0.1:0"], proxy_listen=["127.0.0.1:0"]
    )
    return GatewayHarness(cfg)


def test_stop_removes_the_control_socket(tmp_path: Path) -> None:
    gw = _gateway(tmp_path)
    path = Path(gw.config.gateway.control_socket)
    gw.start()
    try:
        assert gw.control.health()["ok"] is True
        assert path.is_socket() and (path.stat().st_mode & 0o777) == 0o600
    finally:
        gw.stop()
    assert not path.exists()


def test_stop_leaves_a_socket_that_is_not_ours(tmp_path: Path) -> None:
    gw = _gateway(tmp_path)
    path = Path(gw.config.gateway.control_socket)
    gw.start()
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # another instance took the path over while this one still runs
        os.unlink(path)
        other.bind(str(path))
        theirs = path.stat().st_ino
    finally:
        gw.stop()
    try:
        assert path.is_socket() and path.stat().st_ino == theirs
    finally:
        other.close()
        path.unlink(missing_ok=True)
