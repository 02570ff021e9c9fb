"""In-process writes of a netns' sysctls (the gVisor start path): they land in that
namespace only, bad keys are refused before anything is written, and strict failures
raise while best-effort ones do not."""

from __future__ import annotations

import os
import subprocess
import sys
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


def _in_read_only_proc_sys(code: str, *, drop_sys_admin: bool = False
                           ) -> subprocess.CompletedProcess[str]:
    """`code` run by Python in a mount namespace whose /proc/sys is a read-only bind (what
    a container runtime gives an unprivileged container), optionally without
    CAP_SYS_ADMIN in its bounding set (so without it once python is exec'd)."""
    drop = "setpriv --bounding-set -sys_admin " if drop_sys_admin else ""
    script = (f"mount --bind -o ro /proc/sys /proc/sys && test ! -w /proc/sys/net && "
              f"exec {drop}{sys.executable} -c \"$0\"")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           script, code], capture_output=True, text=True, check=False)


WRITE = ("from stockade.launcher import nssysctl; nssysctl.write({ns!r}, "
         "[('net.ipv4.ping_group_range', '0 2147483647')])")


def test_read_only_proc_sys_uses_a_private_procfs(ns: str) -> None:
    """The chart's unprivileged launcher: /proc/sys read-only, CAP_SYS_ADMIN held. The
    write lands in the sandbox's namespace; the caller's /proc/sys stays read-only."""
    assert _get("net.ipv4.ping_group_range", ns) != ["0", "2147483647"]
    code = WRITE.format(ns=f"/run/netns/{ns}") + (
        "; import os; assert os.statvfs('/proc/sys').f_flag & os.ST_RDONLY")
    proc = _in_read_only_proc_sys(code)
    assert proc.returncode == 0, proc.stderr
    assert _get("net.ipv4.ping_group_range", ns) == ["0", "2147483647"]


def test_read_only_proc_sys_without_sys_admin_fails_closed(ns: str) -> None:
    before = _get("net.ipv4.ping_group_range", ns)
    proc = _in_read_only_proc_sys(WRITE.format(ns=f"/run/netns/{ns}"), drop_sys_admin=True)
    assert proc.returncode != 0
    assert "/proc/sys is read-only and no private procfs could be mounted" in proc.stderr
    assert "CAP_SYS_ADMIN" in proc.stderr
    assert _get("net.ipv4.ping_group_range", ns) == before
