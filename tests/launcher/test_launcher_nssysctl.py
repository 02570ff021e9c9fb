"""In-process writes of a netns' sysctls (the gVisor start path): they land in that
namespace only, bad keys are refused before anything is written, and strict failures
raise while best-effort ones do not."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
from stockade.launcher import nssysctl

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns)")


def _get(key: str, ns: str | None = None) -> str:
    pre = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.run([*pre, "sysctl", "-n", key], capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"nssys{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def test_writes_land_in_the_namespace_only(ns: str) -> None:
    host = (_get("net.ipv6.conf.all.disable_ipv6"), _get("net.ipv4.ping_group_range"))
    nssysctl.write(f"/run/netns/{ns}", [("net.ipv6.conf.all.disable_ipv6", "1"),
                                        ("net.ipv4.ping_group_range", "0 2147483647")])
    assert _get("net.ipv6.conf.all.disable_ipv6", ns) == ["1"]
    assert _get("net.ipv4.ping_group_range", ns) == ["0", "2147483647"]
    assert (_get("net.ipv6.conf.all.disable_ipv6"), _get("net.ipv4.ping_group_range")) == host


def test_bad_key_refused_before_any_write(ns: str) -> None:
    for key in ("kernel.pid_max", "net..x", "net.ipv4/../../x"):
        with pytest.raises(ValueError, match="not a net"):
            nssysctl.write(f"/run/netns/{ns}", [("net.ipv6.conf.all.disable_ipv6", "1"),
                                                (key, "1")])
    assert _get("net.ipv6.conf.all.disable_ipv6", ns) == ["0"]


def test_strict_failure_raises_best_effort_does_not(ns: str) -> None:
    before = _get("net.ipv4.tcp_congestion_control", ns)
    with pytest.raises(OSError, match="tcp_congestion_control=no-such-algorithm"):
        nssysctl.write(f"/run/netns/{ns}",
                       [("net.ipv4.tcp_congestion_control", "no-such-algorithm")])
    nssysctl.write(f"/run/netns/{ns}",
                   [("net.ipv4.tcp_congestion_control", "no-such-algorithm"),
                    ("net.ipv6.conf.default.disable_ipv6", "1")], strict=False)
    assert _get("net.ipv4.tcp_congestion_control", ns) == before
    assert _get("net.ipv6.conf.default.disable_ipv6", ns) == ["1"]


def test_missing_namespace_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError):
        nssysctl.write("/run/netns/nssys-no-such-ns", [("net.ipv4.ping_group_range", "0 0")])
