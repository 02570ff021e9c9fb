"""A pooled guest's warm-up commands (`guest_pool.warm_up`) on this host, as root: each
runs once as the sandbox user, with /dev/null as stdio and a fixed environment, in a mount
namespace of its own where every mount is read-only (what it writes cannot outlive it),
and is killed when it hangs. It reports to the test over an abstract Unix socket, which
no mount reaches. (In a guest the same code runs before any task exists:
test_microvm_pool.py checks a claimed task finds nothing of it.)

The pooled command's child, forked by guest_init.py's own code (its functions without its
`main()`): before any plan it is the sandbox user under the pool's seccomp filter, says so
and is moved into the command's cgroup (a file stands in for it); it runs only a plan of
that filter (`keep_child` lets it go otherwise, and it refuses one handed anyway). A
pooled guest checks its image before it waits for a claim."""

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
            "/usr/bin/python3", "-I", "-c", REPORT.format(path=str(target), sock=name)],
            {"LANG": "C.UTF-8"})
        conn, _ = srv.accept()
        with conn:
            got = eval(conn.recv(65536).decode())  # noqa: S307 - the test's own child
    uid, gid, wrote, env, cwd, fds = got
    assert (uid, gid) == (65534, 65534)
    assert wrote == "30"  # EROFS: every mount is read-only in its view
    assert not target.exists()
    # the fixed environment with the locale the pool's tasks get (as the claim's start)
    assert env == {**guest_pool.WARMUP_ENV, "LANG": "C.UTF-8"} and cwd == "/"
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


# --- the pooled command's child: the pool's filter ahead, then only a plan of that filter

SYSTEM_PYTHON = "/usr/bin/python3"  # the guest init's interpreter, with python3-seccomp
STATUS = "grep -E '^(Uid|Seccomp|Seccomp_filters):' /proc/self/status; " \
    "unshare -U true 2>&1 || echo unshare-refused"


@pytest.fixture(scope="module")
def guest_init() -> ModuleType:
    """guest_init.py's functions, without its `main()` (it runs on import as the guest's
    init), with guest_agent (its `wire()`) loaded as the plan's modules would be."""
    here = Path(__file__).parents[2] / "launcher"
    sys.path.insert(0, str(here))
    try:
        import guest_agent  # noqa: F401 - in sys.modules, as the guest loads it
    finally:
        sys.path.pop(0)
    src = (here / "guest_init.py").read_text()
    body, tail = src.rsplit("\nmain()", 1)
    assert not tail.strip()
    mod = ModuleType("guest_init_under_test")
    exec(compile(body, "guest_init.py", "exec"), mod.__dict__)  # noqa: S102 - ours
    return mod


def _filters() -> tuple[bytes, bytes]:
    """(a profile's without relaxations, one relaxing ptrace)"""
    from stockade.launcher import seccomp_bpf
    from stockade.policy.model import SyscallRelaxation

    debug = SimpleNamespace(name="d", syscalls=SyscallRelaxation(frozenset({"ptrace"}), "t"))
    return (seccomp_bpf.filter_for(SYSTEM_PYTHON, None),
            seccomp_bpf.filter_for(SYSTEM_PYTHON, debug))


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as fh:
        return {k: v.split()[0] for k, _, v in (ln.partition(":") for ln in fh) if v.strip()}


def _pooled_child(guest_init: ModuleType, guest_pool: ModuleType, cg: Path,
                  seccomp: bytes) -> tuple[Any, int]:
    """A pooled guest's command child as `guest_pool.claimed` makes it (stdout and stderr on
    one pipe), settled: (its (pid, pipe) or None, the output's read end)."""
    (cg / "cgroup.procs").write_text("")  # stands in for the command's cgroup
    out_r, out_w = os.pipe()
    ahead = {"uid": 65534, "gid": 65534, "rlimits": {}, "seccomp": seccomp}
    command = guest_init.fork_child(None, str(cg), (out_w, out_w), ahead=ahead)
    os.close(out_w)
    return guest_pool.settled(guest_init, str(cg), command), out_r


def _output(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode()


def _plan(seccomp: bytes) -> dict[str, Any]:
    return {"argv": ["/bin/sh", "-c", STATUS], "env": {"PATH": "/usr/bin:/bin"}, "cwd": "/",
            "stdin": False, "stdin_data": None, "seccomp": seccomp}


def test_a_pooled_child_loads_the_pools_filter_before_it_is_moved_and_handed(
        guest_init: ModuleType, guest_pool: ModuleType, tmp_path: Path) -> None:
    """Before any plan: the sandbox user under the pool's filter, then moved into the
    command's cgroup (`settled`); a plan of that filter runs under it alone."""
    default, _ = _filters()
    command, out = _pooled_child(guest_init, guest_pool, tmp_path, default)
    assert command is not None
    pid, ctl = command
    try:
        status = _status(pid)  # it waits for its plan: nothing of a task reached it
        assert (status["Uid"], status["Seccomp"], status["Seccomp_filters"]) == \
            ("65534", "2", "1")
        assert (tmp_path / "cgroup.procs").read_text() == str(pid)  # moved before the claim
    finally:
        kept = guest_pool.keep_child({"seccomp": default}, _plan(default), command)
        assert kept == command
        assert guest_init.wire().hand(ctl, _plan(default))
        _, st = os.waitpid(pid, 0)
    said = _output(out)
    assert os.waitstatus_to_exitcode(st) == 0, said
    # one filter (not loaded twice), and it refuses what the default profile denies
    assert said.split("\n")[:3] == ["Uid:\t65534\t65534\t65534\t65534", "Seccomp:\t2",
                                    "Seccomp_filters:\t1"], said
    assert "Operation not permitted" in said and said.rstrip().endswith("unshare-refused")


def test_a_claim_of_another_filter_never_runs_in_the_pooled_child(
        guest_init: ModuleType, guest_pool: ModuleType, tmp_path: Path) -> None:
    """A profile relaxing ptrace: under the pool's filter too, the stricter one would hold.
    `keep_child` lets the child go (its pipe closed: it leaves, running nothing) and the
    init forks a fresh one; handed such a plan anyway, the child refuses it."""
    default, debug = _filters()
    command, out = _pooled_child(guest_init, guest_pool, tmp_path, default)
    assert command is not None
    assert guest_pool.keep_child({"seccomp": default}, _plan(debug), command) is None
    _, st = os.waitpid(command[0], 0)
    assert os.waitstatus_to_exitcode(st) == 0 and _output(out) == ""  # ran nothing
    command, out = _pooled_child(guest_init, guest_pool, tmp_path, default)
    assert command is not None
    assert guest_init.wire().hand(command[1], _plan(debug))  # (what keep_child prevents)
    _, st = os.waitpid(command[0], 0)
    said = _output(out)
    assert os.waitstatus_to_exitcode(st) == 126
    assert "the plan's seccomp filter is not the one loaded ahead" in said, said
    assert "Seccomp" not in said  # the command never ran


def test_a_pooled_child_that_ends_before_it_is_ready_is_not_kept(
        guest_init: ModuleType, guest_pool: ModuleType, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A child that could not load the filter says so (on the init's stderr: it has no
    task's yet) and ends: `settled` keeps none and moves nothing into the cgroup (the
    claim forks a fresh child, which loads the plan's filter or fails as a cold start's)."""
    command, out = _pooled_child(guest_init, guest_pool, tmp_path, b"")
    assert command is None
    assert (tmp_path / "cgroup.procs").read_text() == ""  # never moved in
    assert _output(out) == ""
    _, st = os.wait()
    assert os.waitstatus_to_exitcode(st) == 126
    assert "the plan carries no seccomp filter" in capfd.readouterr().err


def test_a_pooled_guest_checks_its_image_before_it_waits_for_a_claim(
        guest_init: ModuleType, guest_pool: ModuleType) -> None:
    """An image whose init neither locks the kernel down nor leaves the inputs to
    guest_init is refused (`image_checked`); a pooled guest finds out before anything else,
    not on a claim's path (its input table is the same for every task it could get)."""
    locked = Path("/proc/sys/kernel/modules_disabled")
    if locked.exists() and locked.read_text().strip() == "1":
        pytest.skip("this host's kernel is locked down like a guest's")
    with pytest.raises(OSError):  # this host: modules load (or it has no such switch)
        guest_init.image_checked()
    calls: list[str] = []

    def outdated() -> str:
        calls.append("image_checked")
        raise OSError("the guest image is outdated")

    def step(name: str) -> Any:
        return lambda *a, **k: calls.append(name)

    init = SimpleNamespace(libc=step("libc"), image_checked=outdated, refresh=step("refresh"),
                           network=step("network"), sysctls=step("sysctls"),
                           make_cgroup=step("make_cgroup"), limit_cgroup=step("limit_cgroup"),
                           fork_child=step("fork_child"), agent_port=step("agent_port"))
    pooled = {"fresh": {}, "net": {}, "ahead": {}, "seccomp": b"\0" * 8, "warmup": []}
    with pytest.raises(OSError, match="outdated"):
        guest_pool.claimed(init, pooled, 1, 2)
    assert calls == ["libc", "image_checked"]  # no network, child or agent port yet
