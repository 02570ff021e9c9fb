"""A pooled guest's warm-up commands (`guest_pool.warm_up`) on this host, as root: each
runs once as the sandbox user, with /dev/null as stdio and a fixed environment, in a mount
namespace of its own where every mount is read-only (what it writes cannot outlive it),
and is killed when it hangs. It reports to the test over an abstract Unix socket, which
no mount reaches. (In a guest the same code runs before any task exists:
test_microvm_pool.py checks a claimed task finds nothing of it.)"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="forks, unshares and setuids as root")

REPORT = """import os, socket
fds = [os.path.exists(f"/proc/self/fd/{{fd}}") for fd in (3, 4, 5)]
try:
    open({path!r}, "w")
    wrote = "wrote"
except OSError as e:
    wrote = str(e.errno)
s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
s.send(repr((os.getuid(), os.getgid(), wrote, dict(os.environ), os.getcwd(), fds)).encode())
"""


@pytest.fixture(scope="module")
def guest_pool() -> ModuleType:
    sys.path.insert(0, str(Path(__file__).parents[2] / "launcher"))
    try:
        import guest_pool  # in the guest a top-level module loaded from the plan
    finally:
        sys.path.pop(0)
    return guest_pool


class _Sock(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _init() -> Any:
    """guest_init's `libc` and `become` (a script that runs on import: not importable)."""
    def become(ahead: dict[str, int]) -> None:
        os.setgroups([])
        os.setresgid(ahead["gid"], ahead["gid"], ahead["gid"])
        os.setresuid(ahead["uid"], ahead["uid"], ahead["uid"])

    lib = (ctypes, ctypes.CDLL(None, use_errno=True), _Sock)
    return SimpleNamespace(libc=lambda: lib, become=become)


def test_a_warm_up_runs_as_the_sandbox_user_and_writes_nothing(
        guest_pool: ModuleType, tmp_path: Path) -> None:
    # /tmp: the sandbox user may write there (sticky, world-writable), but for the view
    target = Path(f"/tmp/stockade-warmup-{os.getpid()}")
    target.unlink(missing_ok=True)
    name = f"\0stockade-warmup-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(name)
        srv.listen(1)
        srv.settimeout(30)
        guest_pool.warm_up(_init(), {"uid": 65534, "gid": 65534}, [
            "/usr/bin/python3", "-I", "-c", REPORT.format(path=str(target), sock=name)])
        conn, _ = srv.accept()
        with conn:
            got = eval(conn.recv(65536).decode())  # noqa: S307 - the test's own child
    uid, gid, wrote, env, cwd, fds = got
    assert (uid, gid) == (65534, 65534)
    assert wrote == "30"  # EROFS: every mount is read-only in its view
    assert not target.exists()
    assert env == guest_pool.WARMUP_ENV and cwd == "/"
    assert fds == [False, False, False]  # nothing of the init's beyond stdio
    probe = tmp_path / "still-writable"
    probe.write_text("x")  # the test's own namespace is untouched
    assert probe.read_text() == "x"


def test_a_hung_or_missing_warm_up_ends_and_fails_nothing(
        guest_pool: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest_pool, "WARMUP_S", 1)
    t0 = time.monotonic()
    guest_pool.warm_up(_init(), {"uid": 65534, "gid": 65534}, ["/bin/sleep", "60"])
    assert time.monotonic() - t0 < 50  # killed by its alarm, long before its own end
    guest_pool.warm_up(_init(), {"uid": 65534, "gid": 65534}, ["/nonexistent/cmd"])
