"""A sandbox's basic contract: command, exit code, env, registration, filesystem."""

from __future__ import annotations

import json

import pytest

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
    assert set(out["env"]) <= {"PATH", "HOME", "TMPDIR", "STOCKADE_BROKER", "LANG", "LC_ALL",
                               "TERM", "TZ", "PWD"}
    assert out["env"]["HOME"] == "/scratch/home"
    assert "PROXY" not in " ".join(out["env"]).upper()
    assert out["uid"] == 65534 and out["cwd"] == "/scratch"
    # deregistered from both at teardown
    assert lab.gateway_registry.get(res.task_id) is None
    assert lab.broker_registry.get(res.task_id) is None
    kinds = [(e["event"]["action"], e["stockade"].get("lifecycle"))
             for e in lab.events(res.task_id)]
    assert kinds[0] == ("sandbox_lifecycle", "start") and kinds[-1] == ("sandbox_lifecycle", "end")
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


def test_sandbox_sees_no_host_secrets(lab: Lab) -> None:
    res = lab.run(["sh", "-c", "ls /; ls /root /home /work /var /run 2>&1; "
                   "cat /etc/shadow 2>&1; hostname"])
    listing = res.stdout.split()
    for name in ("root", "home", "work", "var", "run"):
        assert name not in listing[:12]
    assert "Permission denied" in res.stdout  # shadow unreadable for the sandbox user
    assert res.stdout.rstrip().endswith("sandbox")


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
