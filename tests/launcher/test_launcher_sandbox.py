"""A sandbox's basic contract: command, exit code, env, registration, filesystem."""

from __future__ import annotations

import fnmatch
import json
import secrets
import time
from pathlib import Path

import pytest
from stockade.launcher import initscript
from stockade.launcher.spec import SandboxSpec
from stockade.launcher.trust import TRUST_BUNDLE_NAME

from stockade.trust import TRUST_ENV_VARS

from .conftest import Lab

pytestmark = pytest.mark.netns


def test_runs_command_registered_with_both_services(lab: Lab) -> None:
    code = (
        "import os, json, urllib.request\n"
        "b = os.environ['STOCKADE_BROKER']\n"
        "body = urllib.request.urlopen(b + '/v1/whoami', timeout=5).read().decode()\n"
        "print(json.dumps({'env': dict(os.environ), 'broker_says': body, 'uid': os.getuid(),"
        " 'cwd': os.getcwd()}))\n"
    )
    res = lab.py(code)
    assert res.exit_code == 0, res.stderr
    assert res.ended_by == "exit"
    out = json.loads(res.stdout)
    # the broker saw the sandbox's own address, already registered as this task
    assert out["broker_says"] == res.task_id
    # (and the inspection CA's bundle for clients: launcher/trust.py)
    assert set(out["env"]) <= {"PATH", "HOME", "TMPDIR", "STOCKADE_BROKER", "LANG", "LC_ALL",
                               "TERM", "TZ", "PWD", *TRUST_ENV_VARS}
    assert out["env"]["HOME"] == "/scratch/home"
    assert "PROXY" not in " ".join(out["env"]).upper()
    assert out["uid"] == 65534 and out["cwd"] == "/scratch"
    # deregistered from both at teardown
    assert lab.gateway_registry.get(res.task_id) is None
    assert lab.broker_registry.get(res.task_id) is None
    kinds = [(e["event"]["action"], e["stockade"].get("lifecycle"))
             for e in lab.events(res.task_id)]
    # the task record (signed) follows the end event
    assert kinds[0] == ("sandbox_lifecycle", "start")
    assert kinds[-2:] == [("sandbox_lifecycle", "end"), ("sandbox_lifecycle", "record")]
    assert res.timings["setup_s"] > 0


def test_exit_code_and_stderr_pass_through(lab: Lab) -> None:
    res = lab.run(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (res.exit_code, res.stdout, res.stderr, res.ended_by) == (7, "out\n", "err\n", "exit")
    assert res.denials == []


def test_output_is_scrubbed(lab: Lab) -> None:
    res = lab.run(["sh", "-c", "cat /etc/resolv.conf; echo $STOCKADE_BROKER; pwd"],
                  inputs=[(str(lab.tmp), "/inputs/lab")])
    host_ip = res.stdout.split()[1]
    assert host_ip == "<infra-address>"
    assert str(lab.tmp) not in res.stdout


def test_scrubbing_keeps_public_paths(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host values that are well-known system paths (SSL_CERT_DIR=/etc/ssl/certs) are not
    rewritten in the output; the host's scratch path still is."""
    monkeypatch.setenv("SSL_CERT_DIR", "/etc/ssl/certs")
    monkeypatch.setenv("STOCKADE_TEST_LIBS", "/usr/lib")
    scratch = str(lab.launcher.scratch_base)
    res = lab.run(["echo", "/etc/ssl/certs", "/usr/lib", f"{scratch}/x"])
    assert res.stdout == "/etc/ssl/certs /usr/lib <host-path>/x\n", res.stdout


def test_truncated_output_says_so(lab: Lab) -> None:
    """Past max_output_bytes the result says the stream was cut and how much was written."""
    from stockade.launcher import Launcher
    from stockade.launcher.service import result_from_json

    ls = lab.config.launcher
    cfg = lab.config.model_copy(update={"launcher": ls.model_copy(
        update={"max_output_bytes": 1024})})
    other = Launcher(cfg, nflog=False)
    try:
        res = other.run(SandboxSpec("test", ["sh", "-c", "head -c 3000 /dev/zero | tr '\\0' x; "
                                             "echo short >&2"]), lab.ruleset)
    finally:
        other.close()
    assert res.stdout == "x" * 1024
    assert (res.stdout_truncated, res.stdout_bytes) == (True, 3000)
    assert (res.stderr_truncated, res.stderr_bytes, res.stderr) == (False, 6, "short\n")
    back = result_from_json(json.loads(json.dumps(res.to_json())))
    assert (back.stdout_truncated, back.stdout_bytes) == (True, 3000)
    res = lab.run(["echo", "hi"])
    assert (res.stdout_truncated, res.stdout_bytes, res.stderr_truncated) == (False, 3, False)


def test_sandbox_sees_no_host_secrets(lab: Lab) -> None:
    res = lab.run(["sh", "-c", "ls /; ls /root /home /work /var /run 2>&1; "
                   "cat /etc/shadow 2>&1; hostname"])
    listing = res.stdout.split()
    for name in ("root", "home", "work", "var", "run"):
        assert name not in listing[:12]
    assert "No such file" in res.stdout  # the minimal /etc has no shadow at all
    assert res.stdout.rstrip().endswith("sandbox")


def test_minimal_etc_hides_host_configuration(lab: Lab) -> None:
    marker = Path("/etc") / f"stockade-test-marker-{secrets.token_hex(4)}"
    marker.write_text("host only\n")
    marker.chmod(0o644)  # world-readable on the host: only its absence protects it
    try:
        paths = ["/etc/shadow", "/etc/gshadow", "/etc/ssh", "/etc/stockade", str(marker),
                 "/etc/machine-id", "/etc/ssl/private", "/etc/sudoers", "/etc/pip.conf"]
        res = lab.run(["sh", "-c", f"for p in {' '.join(paths)}; do test -e $p && "
                       "echo PRESENT $p; done; ls -A /etc"])
    finally:
        marker.unlink()
    assert res.exit_code == 0, res.stderr
    assert "PRESENT" not in res.stdout
    s = lab.config.launcher
    names = set(res.stdout.split())
    assert set(initscript.GENERATED_ETC) <= names
    # nothing beyond the generated files and the allowlist's first path segments
    allowed = {e.split("/")[0] for e in s.etc_allowlist}
    extra = {n for n in names - {*initscript.GENERATED_ETC, TRUST_BUNDLE_NAME}
             if not any(fnmatch.fnmatch(n, a) for a in allowed)}
    assert extra == set()


def test_sandbox_user_and_generated_files(lab: Lab) -> None:
    script = ("id; echo --; whoami; echo --; getent passwd; echo --; cat /etc/passwd; "
              "echo --; getent group; "
              "echo --; for f in /etc/passwd /etc/group /etc/hosts /etc/resolv.conf "
              "/etc/nsswitch.conf /etc/hostname; do (echo x >> $f) 2>/dev/null && "
              "echo WROTE $f; stat -c '%u %a %n' $f; done; "
              "(touch /etc/new) 2>/dev/null && echo WROTE /etc/new; stat -c '%u %a' /etc")
    res = lab.run(["sh", "-c", script])
    assert res.exit_code == 0, res.stderr
    s = lab.config.launcher
    want = initscript.etc_content("x", "sandbox", s.sandbox_uid, s.sandbox_gid)
    ident, user, getent, passwd, group, files = res.stdout.split("--\n")
    assert ident.startswith("uid=65534(nobody) gid=65534(nogroup)")
    assert user == "nobody\n"
    # /root is a public path: the output scrubber leaves it (and the rest) as it is
    assert getent == passwd == want["passwd"]
    assert [line.split(":")[0] for line in passwd.splitlines()] == ["root", "nobody"]
    assert group == want["group"]
    assert "WROTE" not in files
    # root-owned 0644 files (read-only binds) in a root-owned 0755 /etc
    assert [line.split()[:2] for line in files.splitlines()] == [["0", "644"]] * 6 + [
        ["0", "755"]]


def test_ordinary_tools_find_their_etc(lab: Lab) -> None:
    code = (
        "import json, mimetypes, os, socket, ssl, subprocess, time\n"
        "p = ssl.get_default_verify_paths()\n"
        "ctx = ssl.create_default_context()\n"
        "print(json.dumps({\n"
        " 'bundle': os.path.getsize('/etc/ssl/certs/ca-certificates.crt') > 0,\n"
        " 'capath': os.path.isdir(p.openssl_capath),\n"
        " 'ctx_verify': ctx.verify_mode == ssl.CERT_REQUIRED,\n"
        " 'https': socket.getservbyname('https'), 'tcp': socket.getprotobyname('tcp'),\n"
        " 'lo': socket.gethostbyname('localhost'),\n"
        " 'json': mimetypes.guess_type('a.json')[0], 'tz': time.tzname[0],\n"
        " 'awk': subprocess.run(['awk', 'BEGIN{print 1}'], capture_output=True,\n"
        "                       text=True).stdout.strip(),\n"
        " 'os': open('/etc/os-release').read().startswith(('PRETTY_NAME', 'NAME')),\n"
        "}))\n"
    )
    res = lab.py(code)
    assert res.exit_code == 0, res.stderr
    got = json.loads(res.stdout)
    assert got == {"bundle": True, "capath": True, "ctx_verify": True, "https": 443, "tcp": 6,
                   "lo": "127.0.0.1", "json": "application/json",
                   "tz": time.tzname[0], "awk": "1", "os": True}
    pip = lab.run(["python3", "-m", "pip", "--version"])
    assert pip.exit_code == 0, pip.stderr


def check_ro_binds_with_etc(lab: Lab, profile: str) -> None:
    """With /etc listed in ro_binds, a sandbox of `profile` sees the host's whole /etc with
    the generated resolv.conf, hosts and hostname over it (both backends)."""
    from stockade.launcher import Launcher, SandboxSpec

    ls = lab.config.launcher
    cfg = lab.config.model_copy(update={"launcher": ls.model_copy(
        update={"ro_binds": [*ls.ro_binds, "/etc"]})})
    other = Launcher(cfg, nflog=False)
    try:
        res = other.run(SandboxSpec(profile, ["sh", "-c", "test -d /etc/ssh && echo SSH; "
                                             "cat /etc/resolv.conf /etc/hostname"]), lab.ruleset)
    finally:
        other.close()
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "SSH" and lines[1].startswith("nameserver ")
    assert lines[-1] == "sandbox"


def test_ro_binds_with_etc_keeps_the_host_etc(lab: Lab) -> None:
    """Listing /etc in ro_binds explicitly keeps the whole host /etc (documented)."""
    check_ro_binds_with_etc(lab, "test")


def test_control_sockets_not_reachable(lab: Lab) -> None:
    res = lab.run(["sh", "-c", f"ls {lab.config.gateway.control_socket} "
                   f"{lab.config.broker.control_socket}"])
    assert res.exit_code != 0
    assert "No such file" in res.stderr


def test_stdin_and_unknown_profile(lab: Lab) -> None:
    from stockade.launcher import LauncherError, SandboxSpec

    res = lab.launcher.run(SandboxSpec("test", ["cat"], stdin=b"piped"), lab.ruleset)
    assert res.stdout == "piped"
    with pytest.raises(LauncherError, match="unknown profile"):
        lab.launcher.run(SandboxSpec("nope", ["true"]), lab.ruleset)
    with pytest.raises(LauncherError, match="reserved"):
        lab.launcher.run(SandboxSpec("test", ["true"], inputs=[("/etc", "/scratch/x")]),
                         lab.ruleset)
    assert lab.launcher.list() == []


def test_registration_failure_fails_closed(lab: Lab) -> None:
    from stockade.launcher import Launcher, LauncherError, SandboxSpec

    broken = lab.config.model_copy(update={"broker": lab.config.broker.model_copy(
        update={"control_socket": str(lab.tmp / "missing.sock")})})
    other = Launcher(broken, nflog=False)
    with pytest.raises(LauncherError, match="cannot register"):
        other.run(SandboxSpec("test", ["touch", "/scratch/ran"]), lab.ruleset)
    assert other.list() == []
    assert lab.gateway_registry.tasks() == []  # the half-done registration was undone
    s = lab.config.launcher
    import os

    assert os.listdir(s.scratch_dir) == []


def test_rlimits(lab: Lab) -> None:
    res = lab.run(["sh", "-c", "ulimit -n; ulimit -c; ulimit -Hn; ulimit -l"])
    s = lab.config.launcher
    assert res.stdout.split() == [str(s.rlimit_nofile), "0", str(s.rlimit_nofile),
                                  str(s.rlimit_memlock // 1024)]


def test_tcp_congestion_control_is_set_inside_the_sandbox(lab: Lab) -> None:
    host = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    res = lab.run(["cat", "/proc/sys/net/ipv4/tcp_congestion_control"])
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip() == lab.config.launcher.congestion_control == "reno"
    # the host's own default is untouched (the setting is per network namespace)
    assert Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip() == host


def test_a_tier_without_a_backend_is_refused(lab: Lab) -> None:
    from stockade.launcher import LauncherError, SandboxSpec

    strict = lab.launcher.s
    # gvisor without runsc: refused with what is missing, before anything is created
    lab.launcher.s = strict.model_copy(update={"gvisor": strict.gvisor.model_copy(
        update={"runsc": "/nonexistent/runsc"})})
    try:
        with pytest.raises(LauncherError, match=r"asks for isolation 'gvisor'.*runsc "
                           r"\(/nonexistent/runsc\) is not installed.*"
                           r"launcher\.downgrade_isolation"):
            lab.launcher.run(SandboxSpec("gv", ["true"]), lab.ruleset)
    finally:
        lab.launcher.s = strict
    # microvm without its image: refused with how to build it, before anything is created
    lab.launcher.s = strict.model_copy(update={"microvm": strict.microvm.model_copy(
        update={"image_dir": str(lab.tmp / "no-image")})})
    try:
        with pytest.raises(LauncherError, match=r"asks for isolation 'microvm'.*"
                           r"vm-images/build\.sh.*launcher\.downgrade_isolation"):
            lab.launcher.run(SandboxSpec("vm", ["true"]), lab.ruleset)
    finally:
        lab.launcher.s = strict
    assert lab.launcher.list() == []  # refused before anything was created


def test_a_configured_downgrade_runs_and_the_start_event_says_so(lab: Lab) -> None:
    from stockade.launcher import SandboxSpec

    strict = lab.launcher.s
    lab.launcher.s = strict.model_copy(update={"downgrade_isolation": ["gvisor", "microvm"],
                                               "microvm": strict.microvm.model_copy(
                                                   update={"enabled": False}),
                                               "gvisor": strict.gvisor.model_copy(
                                                   update={"enabled": False})})
    try:
        res = lab.launcher.run(SandboxSpec("gv", ["true"]), lab.ruleset)
        vm = lab.launcher.run(SandboxSpec("vm", ["true"]), lab.ruleset)
    finally:
        lab.launcher.s = strict
    for r, tier in ((res, "gvisor"), (vm, "microvm")):
        assert (r.exit_code, r.ended_by) == (0, "exit")
        start = lab.events(r.task_id)[0]
        assert start["stockade"]["lifecycle"] == "start"
        assert start["stockade"]["isolation"] == "container"
        assert start["stockade"]["isolation_requested"] == tier
        assert "container grade" in start["message"]
    plain = lab.run(["true"])
    first = lab.events(plain.task_id)[0]["stockade"]
    assert first["isolation"] == "container" and "isolation_requested" not in first


def test_loader_variables_reach_the_command_not_the_root_init(lab: Lab, tmp_path: Path) -> None:
    """LD_PRELOAD naming a host file (e.g. one any local user could plant in the host's
    /tmp): the netns init, root and still in the host's tree, never runs with the caller's
    environment, so the loader never opens it there; the command gets the variable (the
    file does not exist in the sandbox)."""
    bogus = tmp_path / "preload.so"
    bogus.write_bytes(b"not an ELF object" * 10)
    bogus.chmod(0o644)
    res = lab.run(["sh", "-c", 'echo "$LD_PRELOAD"'], env={"LD_PRELOAD": str(bogus)})
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip() in (str(bogus), "<host-path>/preload.so")
    # the root init would have opened the host file: "invalid ELF header"
    assert "ELF" not in res.stderr, res.stderr
