"""deploy/systemd: the units parse, carry the hardening an appliance needs, run commands the
CLI accepts, and pass `systemd-analyze verify` / `systemd-tmpfiles` / `systemd-sysusers`
where those are installed."""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_support import (
    DEPLOY,
    EXAMPLE_CONFIG,
    REPO,
    UNITS,
    parse_unit,
    tool,
    unit_value,
    unit_values,
)

from stockade.cli import build_parser

SYSTEMD = DEPLOY / "systemd"
INSTALLED_CLI = "/opt/stockade/.venv/bin/stockade"

REQUIRED = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "RuntimeDirectory": "stockade",
    "RuntimeDirectoryPreserve": "yes",
    "LogsDirectory": "stockade",
    "Restart": "on-failure",
    "User": "stockade",
    "Group": "stockade",
    "ExecReload": "/bin/kill -HUP $MAINPID",
    "SystemCallArchitectures": "native",
    "RestrictSUIDSGID": "yes",
}


@pytest.mark.parametrize("component", sorted(UNITS))
def test_unit_has_required_keys(component: str) -> None:
    unit = parse_unit(UNITS[component])
    assert set(unit) == {"Unit", "Service", "Install"}
    for key, want in REQUIRED.items():
        assert unit_value(unit, "Service", key) == want, f"{component}: {key}"
    assert unit_value(unit, "Service", "StateDirectory") == f"stockade/{component}"
    assert unit_value(unit, "Install", "WantedBy") == "multi-user.target"
    assert unit_value(unit, "Unit", "After") == "network-online.target"
    if component == "gateway":
        # `ip -j addr` (own-address detection) exits if capset() is filtered
        assert "capset" in unit_values(unit, "Service", "SystemCallFilter")
    # RemoveIPC= would wipe the other service's IPC objects: both run as one user
    assert unit_value(unit, "Service", "RemoveIPC") in (None, "no")


@pytest.mark.parametrize("component", sorted(UNITS))
def test_exec_start_is_a_command_the_cli_accepts(component: str) -> None:
    unit = parse_unit(UNITS[component])
    argv = shlex.split(unit_value(unit, "Service", "ExecStart") or "")
    assert argv[0] == INSTALLED_CLI
    assert argv[1:3] == [component, "serve"]
    assert argv[argv.index("--config") + 1] == "/etc/stockade/stockade.yaml"
    args = build_parser().parse_args(argv[1:])
    assert args.func is not None and args.config == "/etc/stockade/stockade.yaml"


@pytest.mark.parametrize(
    ("component", "module"),
    [("gateway", "gateway/service.py"), ("broker", "broker/cli.py")],
)
def test_reload_is_sighup_and_the_service_handles_it(component: str, module: str) -> None:
    """ExecReload sends SIGHUP; without a handler Python would die of it. Both services
    serve through stockade.serving.serve_until_signalled, whose SIGHUP handling is
    exercised for real below."""
    src = (REPO / module).read_text()
    assert "serve_until_signalled(" in src, f"{module} does not serve through stockade.serving"


def test_serve_until_signalled_reloads_on_sighup_and_stops_on_sigterm() -> None:
    import asyncio
    import os
    import signal

    from stockade.serving import serve_until_signalled

    calls: list[str] = []

    async def main() -> int:
        loop = asyncio.get_running_loop()

        async def start() -> None:
            calls.append("start")
            loop.call_later(0.05, os.kill, os.getpid(), signal.SIGHUP)
            loop.call_later(0.3, os.kill, os.getpid(), signal.SIGTERM)

        async def stop() -> None:
            calls.append("stop")

        return await serve_until_signalled(
            "test",
            start=start,
            stop=stop,
            reload=lambda: calls.append("reload"),
            banner=lambda: "up",
        )

    assert asyncio.run(main()) == 0
    assert calls == ["start", "reload", "stop"]


def test_sysusers_and_tmpfiles_name_the_unit_user() -> None:
    users = (SYSTEMD / "stockade.sysusers.conf").read_text()
    assert any(line.split()[:2] == ["u", "stockade"] for line in users.splitlines())
    tmpfiles = (SYSTEMD / "stockade.tmpfiles.conf").read_text()
    rows = [line.split() for line in tmpfiles.splitlines() if line and not line.startswith("#")]
    assert rows[0][:5] == ["d", "/var/lib/stockade", "0755", "root", "root"]
    acl = next(r for r in rows if r[0] == "a+")
    assert acl[1] == "/var/log/stockade" and "default:user:stockade:rw-" in acl[-1]


# -- external checkers ---------------------------------------------------------------------
def _stockade_executable() -> str:
    candidate = Path(sys.executable).parent / "stockade"
    return str(candidate) if os.access(candidate, os.X_OK) else "/bin/true"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "STOCKADE_SYSTEMD_ANALYZE")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    exe = _stockade_executable()
    names = []
    for path in UNITS.values():
        # verify checks that ExecStart is executable: point it at this checkout's CLI
        (tmp_path / path.name).write_text(path.read_text().replace(INSTALLED_CLI, exe))
        names.append(f"./{path.name}")
    proc = subprocess.run(
        [analyze, "verify", "--man=no", *names],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )
    ours = [
        line
        for line in proc.stderr.splitlines()
        if any(n[2:] in line for n in names) or "Unknown" in line or "Failed to parse" in line
    ]
    assert proc.returncode == 0 and not ours, proc.stderr


def test_systemd_analyze_security_exposure(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "STOCKADE_SYSTEMD_ANALYZE")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    exe = _stockade_executable()
    for path in UNITS.values():
        (tmp_path / path.name).write_text(path.read_text().replace(INSTALLED_CLI, exe))
        proc = subprocess.run(
            [analyze, "security", "--offline=yes", "--no-pager", "--threshold=25", path.name],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
        )
        if "Unknown command verb" in proc.stderr or "unrecognized option" in proc.stderr:
            pytest.skip("systemd-analyze security --offline needs systemd >= 250")
        # --threshold=25 (exposure 2.5): fails if the hardening regresses
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr


def test_sysusers_creates_the_user(tmp_path: Path) -> None:
    sysusers = tool("systemd-sysusers", "STOCKADE_SYSTEMD_SYSUSERS")
    if sysusers is None:
        pytest.skip("systemd-sysusers not installed")
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(
        [sysusers, f"--root={tmp_path}", str(SYSTEMD / "stockade.sysusers.conf")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    entry = next(line for line in passwd.splitlines() if line.startswith("stockade:"))
    assert entry.endswith(":/usr/sbin/nologin")


def test_tmpfiles_creates_the_directories_with_acl(tmp_path: Path) -> None:
    tmpfiles = tool("systemd-tmpfiles", "STOCKADE_SYSTEMD_TMPFILES")
    if tmpfiles is None:
        pytest.skip("systemd-tmpfiles not installed")
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles chowns: needs root")
    # ACL names resolve through the host's NSS, owners through <root>/etc/passwd: use a
    # user and group this host has for both
    nobody = pwd.getpwuid(65534)
    group = grp.getgrgid(nobody.pw_gid).gr_name
    text = (SYSTEMD / "stockade.tmpfiles.conf").read_text()
    text = text.replace("stockade stockade", f"{nobody.pw_name} {group}")
    text = text.replace("user:stockade:", f"user:{nobody.pw_name}:")
    conf = tmp_path / "stockade.conf"
    conf.write_text(text)
    root = tmp_path / "root"
    for d in ("etc", "var/lib", "var/log"):
        (root / d).mkdir(parents=True)
    for f in ("passwd", "group"):
        (root / "etc" / f).write_text(Path("/etc", f).read_text())
    proc = subprocess.run(
        [tmpfiles, "--create", f"--root={root}", str(conf)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0 and "Failed" not in proc.stderr, proc.stderr
    logs = root / "var/log/stockade"
    assert logs.stat().st_uid == 65534 and oct(logs.stat().st_mode & 0o777) == "0o750"
    assert "system.posix_acl_default" in os.listxattr(logs)
    lib = root / "var/lib/stockade"
    assert lib.stat().st_uid == 0 and oct(lib.stat().st_mode & 0o777) == "0o755"


def test_example_config_is_what_the_units_read() -> None:
    for path in UNITS.values():
        argv = shlex.split(unit_value(parse_unit(path), "Service", "ExecStart") or "")
        assert argv[argv.index("--config") + 1] == "/etc/stockade/" + EXAMPLE_CONFIG.name
