"""The gVisor tier's pure parts: platform choice, runsc's flags, host limits, the OCI
bundle built from the container tier's plan, runsc's list output."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from polling import eventually
from stockade.launcher import gvisor
from stockade.launcher.initscript import Bind, InitPlan
from stockade.launcher.settings import GvisorSettings
from stockade.policy.model import Limits

SAMPLE_FLAGS = ('    -platform string\n    \tspecifies which platform to use: systrap '
                '(default), ptrace, kvm. (default "systrap")\n')
OLD_FLAGS = "  -platform string\n  \tspecifies which platform to use: ptrace (default), kvm.\n"


def plan(**kw: object) -> InitPlan:
    base = {
        "root": "/b/root", "scratch": "/b/scratch", "etc_dir": "/b/etc", "uid": 65534,
        "gid": 65534,
        "system": (Bind("/usr", "/usr"), Bind("/bin", "/bin", symlink_to="usr/bin")),
        "etc": (Bind("/etc/ssl/certs", "/etc/ssl/certs"),
                Bind("/etc/localtime", "/etc/localtime", symlink_to="/usr/share/zoneinfo/UTC"),
                Bind("/etc/hosts.allow", "/etc/hosts", is_dir=False)),  # shadows a generated
        "etc_files": ("resolv.conf", "hosts", "passwd"),
        "etc_over": (("stockade-ca.crt", "ssl/certs/ca-certificates.crt"),),
        "inputs": (Bind("/data/in", "/inputs/in"),),
        "rlimits": (("NOFILE", 4096), ("CORE", 0)),
    }
    base.update(kw)
    return InitPlan(**base)  # type: ignore[arg-type]


def test_platforms_from_runsc_flags() -> None:
    assert gvisor.platforms(SAMPLE_FLAGS) == {"systrap", "ptrace", "kvm"}
    assert gvisor.platforms(OLD_FLAGS) == {"ptrace", "kvm"}
    assert gvisor.platforms("no such line") == set()


@pytest.mark.parametrize(("setting", "offered", "kvm_ok", "want"), [
    ("auto", {"systrap", "ptrace", "kvm"}, True, "systrap"),
    ("auto", {"ptrace", "kvm"}, True, "ptrace"),  # 20221219: no systrap
    ("ptrace", {"systrap", "ptrace"}, False, "ptrace"),
    ("kvm", {"systrap", "kvm"}, True, "kvm"),
    ("auto", set(), False, "neither systrap nor ptrace"),
    ("systrap", {"ptrace", "kvm"}, False, "no systrap platform"),
    ("kvm", {"systrap", "kvm"}, False, "did not run a probe"),
])
def test_platform_choice(setting: str, offered: set[str], kvm_ok: bool, want: str) -> None:
    if want in gvisor.PLATFORMS:
        assert gvisor.platform_choice(setting, offered, kvm_ok) == want
    else:
        with pytest.raises(ValueError, match=want):
            gvisor.platform_choice(setting, offered, kvm_ok)


def test_global_flags() -> None:
    f = gvisor.global_flags("/usr/bin/runsc", "/run/x/t", "systrap", "host")
    assert f == ["/usr/bin/runsc", "--root=/run/x/t", "--platform=systrap", "--network=host",
                 "--overlay2=none", "--host-uds=none", "--file-access=shared"]
    assert gvisor.global_flags("r", "/s", "ptrace", "sandbox", "/log")[-2:] == [
        "--debug-log=/log/", "--debug"]
    with pytest.raises(ValueError):
        gvisor.global_flags("r", "/s", "qemu", "host")


def test_host_limits_hold_the_sentry() -> None:
    lim = Limits(cpus=0.5, memory=256 * 2**20, disk=2**20, pids=64, ttl=5)
    h = gvisor.host_limits(lim, GvisorSettings())
    assert (h.memory, h.pids, h.cpus) == ((256 + 64) * 2**20, 2 * 64 + 128, 0.5)


def test_root_layout_binds_only_what_the_plan_names() -> None:
    layout = gvisor.root_layout(plan())
    binds = {m["destination"]: m for m in layout.mounts if m["type"] == "bind"}
    assert binds["/usr"]["source"] == "/usr" and binds["/usr"]["options"] == gvisor.RO_BIND
    assert ("/bin", "usr/bin") in layout.symlinks and "/bin" not in binds
    assert ("/etc/localtime", "/usr/share/zoneinfo/UTC") in layout.symlinks
    # generated files from etc_dir, copied into the root; an allowlisted host file never
    # shadows one
    assert [c for c in layout.copies if c[0] == "/etc/hosts"] == [("/etc/hosts", "/b/etc/hosts")]
    assert "/etc/hosts" not in binds and "/etc/hosts" not in layout.files
    assert binds["/etc/ssl/certs/ca-certificates.crt"]["source"] == "/b/etc/stockade-ca.crt"
    dests = [m["destination"] for m in layout.mounts]
    assert dests.index("/etc/ssl/certs") < dests.index("/etc/ssl/certs/ca-certificates.crt")
    assert binds["/scratch"]["options"] == gvisor.RW_BIND
    assert binds["/tmp"]["source"] == "/b/scratch/tmp"
    assert binds["/inputs/in"]["options"] == gvisor.RO_BIND
    # no host path beyond system binds, /etc entries and etc_dir, scratch and inputs
    allowed = ("/usr", "/etc/ssl/certs", "/b/etc/", "/b/scratch", "/data/in")
    assert all(any(m["source"].startswith(a) for a in allowed) for m in binds.values())
    assert all(any(src.startswith(a) for a in allowed) for _, src in layout.copies)
    assert {m["type"] for m in layout.mounts} == {"bind", "proc", "tmpfs"}
    writable = [m["destination"] for m in layout.mounts if "rw" in m.get("options", [])]
    assert writable == ["/scratch", "/tmp"]


def test_root_layout_without_trust_dir_skips_the_bundle_and_host_etc() -> None:
    layout = gvisor.root_layout(plan(etc=()))
    assert all("ca-certificates" not in m["destination"] for m in layout.mounts)
    whole = gvisor.root_layout(plan(host_etc=True, system=(Bind("/etc", "/etc"),)))
    etc = [m for m in whole.mounts if m["destination"].startswith("/etc/")]
    assert [m["source"] for m in etc] == ["/b/etc/resolv.conf", "/b/etc/hosts", "/b/etc/passwd"]
    assert whole.copies == []  # over the host's whole /etc: binds, nothing to copy into


def test_root_layout_copies_single_etc_files_and_binds_directories() -> None:
    layout = gvisor.root_layout(plan(etc=(Bind("/etc/ssl/certs", "/etc/ssl/certs"),
                                          Bind("/etc/ld.so.cache", "/etc/ld.so.cache",
                                               is_dir=False))))
    assert ("/etc/ld.so.cache", "/etc/ld.so.cache") in layout.copies
    etc_binds = [m["destination"] for m in layout.mounts
                 if m["type"] == "bind" and m["destination"].startswith("/etc")]
    # a directory stays a bind, and so does the trust bundle inside it (a file under a
    # bound directory cannot be copied into the root)
    assert etc_binds == ["/etc/ssl/certs", "/etc/ssl/certs/ca-certificates.crt"]


@pytest.mark.parametrize("target", ["/scratch/x", "/usr/lib/x", "/etc/passwd", "/proc",
                                    "/tmp", "/dev/shm", "/opt/ro/x"])
def test_root_layout_refuses_reserved_inputs(target: str) -> None:
    with pytest.raises(ValueError, match="reserved"):
        gvisor.root_layout(plan(inputs=(Bind("/data/in", target),)), ("/opt/ro",))


def test_oci_config_matches_the_prototype() -> None:
    layout = gvisor.root_layout(plan())
    cfg = gvisor.oci_config(layout, "/b/root", ["sh", "-c", "echo hi"], {"PATH": "/usr/bin"},
                            plan(), 64, "/stockade/0123456789")
    sample = json.loads((Path(__file__).parent / "data" / "gvisor_config.json").read_text())
    assert set(cfg) == set(sample)
    assert set(cfg["process"]) == set(sample["process"])
    assert set(cfg["linux"]) == set(sample["linux"])
    p = cfg["process"]
    assert all(v == [] for v in p["capabilities"].values()) and len(p["capabilities"]) == 5
    assert p["noNewPrivileges"] is True and p["terminal"] is False
    assert p["user"] == {"uid": 65534, "gid": 65534, "additionalGids": []}
    assert {"type": "RLIMIT_NPROC", "hard": 64, "soft": 64} in p["rlimits"]
    assert p["cwd"] == "/scratch" and p["env"] == ["PATH=/usr/bin"]
    assert cfg["root"] == {"path": "/b/root", "readonly": True}
    assert "resources" not in cfg["linux"] and "seccomp" not in cfg["linux"]
    assert cfg["linux"]["cgroupsPath"] == "/stockade/0123456789"
    assert {n["type"] for n in cfg["linux"]["namespaces"]} == {"pid", "ipc", "uts", "mount"}


def test_parse_list_and_reconcile_ids() -> None:
    assert gvisor.parse_list("null\n") == [] and gvisor.parse_list("[]") == []
    two = json.dumps([{"id": "0123456789", "status": "running"}, {"id": "abcdefabcd"}])
    assert gvisor.parse_list(two) == ["0123456789", "abcdefabcd"]
    with pytest.raises(ValueError):
        gvisor.parse_list("{}")
    assert gvisor.reconcile_ids(["0123456789", "abcdefabcd", "probe1"], {"abcdefabcd"}) == [
        "0123456789"]


def test_stale_state_files() -> None:
    names = ["0123456789_sandbox:0123456789.lock", "0123456789_sandbox:0123456789.state",
             "runsc-0123456789.sock", "abcdefabcd_sandbox:abcdefabcd.lock", "other", "probe1.x"]
    assert gvisor.stale_state_files(names, {"abcdefabcd"}) == [
        "0123456789_sandbox:0123456789.lock", "0123456789_sandbox:0123456789.state",
        "runsc-0123456789.sock"]


def test_stats_pids() -> None:
    assert gvisor.stats_pids('{"type":"stats","data":{"pids":{"current":63}}}') == 63
    assert gvisor.stats_pids("not json") is None and gvisor.stats_pids("{}") is None


def test_confined(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "link").symlink_to("/")
    assert gvisor.confined(str(tmp_path), "/etc/x") == str(tmp_path / "etc" / "x")
    with pytest.raises(ValueError, match="outside"):
        gvisor.confined(str(tmp_path), "/link/etc/x")


def _run_hook(hook: dict[str, object]) -> subprocess.CompletedProcess[str]:
    """The hook as runsc runs it: its path with its args (argv[0] first), the container's
    state on stdin, its env only."""
    args = list(hook["args"])  # type: ignore[call-overload]
    return subprocess.run([str(hook["path"]), *args[1:]], input='{"id": "x"}',
                          env=dict(e.split("=", 1) for e in hook["env"]),  # type: ignore[attr-defined]
                          capture_output=True, text=True, timeout=10, check=False)


def test_cpu_limit_hook_writes_and_reads_back(tmp_path: Path) -> None:
    quota = tmp_path / "cpu.max"
    quota.write_text("max 100000\n")
    hooks = gvisor.cpu_limit_hooks(str(quota), "50000 100000")
    (hook,) = hooks["prestart"]
    assert hook["timeout"] == gvisor.HOOK_TIMEOUT_S
    p = _run_hook(hook)
    assert p.returncode == 0, p.stderr
    assert quota.read_text() == "50000 100000"


def test_cpu_limit_hook_fails_when_the_limit_does_not_land(tmp_path: Path) -> None:
    # no such cgroup: the write fails; a file that reads back something else: the check does
    for where, value in ((tmp_path / "gone" / "cpu.cfs_quota_us", "50000"),
                         (Path("/dev/null"), "50000")):
        p = _run_hook(gvisor.cpu_limit_hooks(str(where), value)["prestart"][0])
        assert p.returncode != 0
        assert f"the CPU limit {value} did not land in {where}" in p.stderr


def _gate(tmp_path: Path) -> tuple[Path, int]:
    fifo = tmp_path / "start-gate"
    os.mkfifo(fifo, 0o600)
    return fifo, os.open(fifo, os.O_RDWR)  # as the launcher holds it


@pytest.mark.parametrize(("written", "ok"), [(b"go\n", True), (b"nope\n", False)])
def test_start_gate_hook_runs_only_on_go(tmp_path: Path, written: bytes, ok: bool) -> None:
    fifo, fd = _gate(tmp_path)
    hook = gvisor.start_gate_hook(str(fifo))
    assert hook["timeout"] == gvisor.GATE_TIMEOUT_S
    try:
        os.write(fd, written)  # before the hook reads: it stays in the pipe
        p = _run_hook(hook)
    finally:
        os.close(fd)
    assert (p.returncode == 0) is ok, p.stderr
    assert ok or "start was not released" in p.stderr


def test_start_gate_hook_fails_when_the_launcher_closes_it(tmp_path: Path) -> None:
    """Teardown (or the launcher's death) closes the gate unreleased: the hook waiting on
    it reads EOF and fails runsc's start."""
    fifo, fd = _gate(tmp_path)
    args = list(gvisor.start_gate_hook(str(fifo))["args"])
    hook = subprocess.Popen(["/bin/sh", *args[1:]], stderr=subprocess.PIPE, text=True)
    try:
        assert eventually(lambda: any(os.path.realpath(f"/proc/{hook.pid}/fd/{n}") == str(fifo)
                                      for n in os.listdir(f"/proc/{hook.pid}/fd")), timeout=10)
    finally:
        os.close(fd)
    _, err = hook.communicate(timeout=10)
    assert hook.returncode != 0 and "start was not released" in err


def test_hook_probe_config_creates_its_stamp(tmp_path: Path) -> None:
    stamp = tmp_path / "ran"
    config = gvisor.hook_probe_config(str(stamp))
    assert {k: v for k, v in config.items() if k != "hooks"} == gvisor.probe_config()
    assert _run_hook(config["hooks"]["prestart"][0]).returncode == 0
    assert stamp.exists()


def test_copied_etc_file_keeps_mode_and_owner(tmp_path: Path) -> None:
    from stockade.launcher.backends.gvisor_host import materialize

    secret = tmp_path / "host-secret.conf"
    secret.write_text("only root reads this\n")
    os.chown(secret, 1234, 4321)
    os.chmod(secret, 0o4640)  # a set-id bit is not carried over
    layout = gvisor.RootLayout(dirs=["/etc"], copies=[("/etc/app/secret.conf", str(secret))])
    materialize(tmp_path / "root", layout)
    st = (tmp_path / "root/etc/app/secret.conf").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 4321, 0o640)
    assert (tmp_path / "root/etc/app/secret.conf").read_text() == "only root reads this\n"



def test_state_left_needs_more_than_the_lock() -> None:
    lock, state = "0123456789_sandbox:0123456789.lock", "0123456789_sandbox:0123456789.state"
    other = "abcdefabcd_sandbox:abcdefabcd.state"
    assert not gvisor.state_left([lock, other, "probe1.x"], "0123456789")
    assert gvisor.state_left([lock, state], "0123456789")
    assert gvisor.state_left(["runsc-0123456789.sock"], "0123456789")
    assert not gvisor.state_left([], "0123456789")


def test_execd_frames_round_trip_and_split_anywhere() -> None:
    from stockade.launcher import gvisor_execd as wire

    frames = [(1, b"S", b"x" * 70000), (2, b"E", b""), (3, b"O", b"out")]
    data = b"".join(wire.frame(*f) for f in frames)
    for cut in (0, 1, 8, 9, 70008, 70009, len(data) - 1):
        first, rest = wire.unframe(data[:cut])
        second, rest = wire.unframe(rest + data[cut:])
        assert first + second == frames and rest == b""


def test_execd_refuses_an_oversized_frame() -> None:
    from stockade.launcher import gvisor_execd as wire

    with pytest.raises(ValueError, match="frame of"):
        wire.unframe(wire.HEADER.pack(1, ord("O"), wire.MAX_FRAME + 1))
    assert wire.status_of(-9) == 137 and wire.status_of(3) == 3


def test_execd_process_keeps_limits_and_names_the_uid_it_drops_to() -> None:
    first = {"user": {"uid": 65534, "gid": 65534, "additionalGids": []},
             "rlimits": [{"type": "RLIMIT_NPROC", "hard": 64, "soft": 64}],
             "noNewPrivileges": True, "args": ["sleep", "1"], "env": ["SECRET=x"]}
    p = gvisor.execd_process(first, "/usr/bin/python3", "src", "/usr/bin:/bin")
    assert p["user"] == {"uid": 0, "gid": 0, "additionalGids": []}
    assert p["args"] == ["/usr/bin/python3", "-I", "-S", "-c", "src"]
    assert p["env"] == ["PATH=/usr/bin:/bin", "STOCKADE_UID=65534", "STOCKADE_GID=65534"]
    assert p["rlimits"] == first["rlimits"] and p["noNewPrivileges"] is True
    caps = p["capabilities"]
    assert caps["ambient"] == caps["inheritable"] == []
    assert caps["bounding"] == caps["permitted"] == caps["effective"] == gvisor.EXECD_CAPS


def test_copy_inputs_into_a_pooled_root(tmp_path: Path) -> None:
    """The claim's copy (no runsc needed): files and trees without write bits, owners
    kept, symlinks as symlinks, FIFOs remade; refusals name what they refuse."""
    import socket
    import stat

    from stockade.launcher.backends import gvisor_host
    from stockade.launcher.spec import LauncherError

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_text("x")
    (src / "sub" / "f").chmod(0o4777)
    (src / "link").symlink_to("sub/f")
    os.mkfifo(src / "pipe")
    one = tmp_path / "one.txt"
    one.write_text("1")
    root = tmp_path / "root"
    (root / "usr").mkdir(parents=True)
    (root / "out").symlink_to("/")  # a symlink in the root: nothing may go through it
    gvisor_host.copy_inputs(root, [Bind(str(src), "/data/in", is_dir=True),
                                   Bind(str(one), "/inputs/one.txt")], ())
    assert (root / "data/in/sub/f").read_text() == "x" and (root / "inputs/one.txt").exists()
    assert stat.S_IMODE((root / "data/in/sub/f").stat().st_mode) == 0o555
    assert stat.S_IMODE((root / "data/in").stat().st_mode) & 0o222 == 0
    assert os.readlink(root / "data/in/link") == "sub/f"
    assert stat.S_ISFIFO(os.lstat(root / "data/in/pipe").st_mode)
    for bind, why in [(Bind(str(one), "/inputs/one.txt"), "already exists"),
                      (Bind(str(one), "/usr/x"), "reserved"),
                      (Bind(str(one), "/out/etc/x"), "outside the sandbox root")]:
        with pytest.raises(LauncherError, match=why):
            gvisor_host.copy_inputs(root, [bind], ())
    sock_dir = tmp_path / "s"
    sock_dir.mkdir()
    with socket.socket(socket.AF_UNIX) as sk:
        sk.bind(str(sock_dir / "sock"))
        with pytest.raises(LauncherError, match="device or a socket"):
            gvisor_host.copy_inputs(root, [Bind(str(sock_dir), "/data/s", is_dir=True)], ())
