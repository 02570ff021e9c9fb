"""deploy/systemd/stockade-launcher.service: the launcher's control service as a unit.

It runs as root with a bounded capability set and without a mount namespace of its own
(the namespaces and mounts it makes must be the host's); `systemd-analyze security
--offline` holds its exposure where it is, and the options that would give it a private
mount namespace stay out."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_support import DEPLOY, parse_unit, tool, unit_value, unit_values

from stockade.cli import build_parser

UNIT = DEPLOY / "systemd" / "stockade-launcher.service"
INSTALLED_CLI = "/opt/stockade/.venv/bin/stockade"
CAPABILITIES = {
    "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_SYS_CHROOT", "CAP_SETUID", "CAP_SETGID",
    "CAP_SETPCAP", "CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE", "CAP_KILL",
    "CAP_SYS_RESOURCE", "CAP_SYS_PTRACE", "CAP_MKNOD", "CAP_NET_RAW",
}
# each of these gives the unit a mount namespace of its own (systemd.exec(5)): the
# sandboxes' netns and mounts would be invisible to `stockade run` and outlive them
MOUNT_NAMESPACE_OPTIONS = (
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
    "ProtectKernelModules", "ProtectKernelLogs", "ProtectKernelTunables",
    "ProtectControlGroups", "ProtectProc", "ProcSubset", "ReadWritePaths", "ReadOnlyPaths",
    "InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "RootDirectory",
    "MountAPIVFS",
)
# and these break the wiring otherwise: the veths must be made in the host's network
# namespace, capabilities in a user namespace are not the host's, and ProtectClock='s
# device policy hides /dev/kvm and /dev/net/tun
OTHER_BREAKING_OPTIONS = ("PrivateNetwork", "PrivateUsers", "ProtectClock", "DevicePolicy")
# a root unit declaring these would chown the gateway's and broker's shared directories
SHARED_DIRECTORIES = ("RuntimeDirectory", "LogsDirectory", "StateDirectory")
EXPOSURE_MAX = 70  # 7.0; systemd 252 rates this unit 6.9 (MEDIUM, as a root launcher is)


def unit() -> dict[str, list[tuple[str, str]]]:
    return parse_unit(UNIT)


def test_runs_as_root_with_exactly_the_wiring_capabilities() -> None:
    u = unit()
    assert set(u) == {"Unit", "Service", "Install"}
    assert unit_value(u, "Service", "User") in (None, "root")
    caps = set((unit_value(u, "Service", "CapabilityBoundingSet") or "").split())
    assert caps == CAPABILITIES
    assert unit_value(u, "Service", "AmbientCapabilities") == ""
    assert unit_value(u, "Service", "NoNewPrivileges") == "yes"
    families = set((unit_value(u, "Service", "RestrictAddressFamilies") or "").split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"}
    denied = unit_values(u, "Service", "SystemCallFilter")
    assert denied and all(v.startswith("~") for v in denied)
    assert {"@module", "@reboot", "@swap", "@raw-io"} <= set(" ".join(denied)[1:].split())


def test_no_namespace_of_its_own_and_no_shared_directory() -> None:
    u = unit()
    for key in (*MOUNT_NAMESPACE_OPTIONS, *OTHER_BREAKING_OPTIONS, *SHARED_DIRECTORIES):
        assert unit_value(u, "Service", key) is None, key


def test_starts_after_the_gateway_and_broker_and_restarts_like_them() -> None:
    u = unit()
    after = (unit_value(u, "Unit", "After") or "").split()
    assert {"stockade-gateway.service", "stockade-broker.service"} <= set(after)
    assert unit_value(u, "Service", "Restart") == "on-failure"
    assert unit_value(u, "Service", "RestartPreventExitStatus") == "2"
    assert unit_value(u, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"
    # a restart of the service must not kill the sandboxes (they are not in its cgroup)
    assert unit_value(u, "Service", "KillMode") == "mixed"
    assert unit_value(u, "Install", "WantedBy") == "multi-user.target"


def test_exec_start_is_launcher_serve() -> None:
    argv = shlex.split(unit_value(unit(), "Service", "ExecStart") or "")
    assert argv[0] == INSTALLED_CLI
    assert argv[1:3] == ["launcher", "serve"]
    args = build_parser().parse_args(argv[1:])
    assert args.func is not None and args.config == "/etc/stockade/stockade.yaml"


def _local_copy(tmp_path: Path) -> Path:
    candidate = Path(sys.executable).parent / "stockade"
    exe = str(candidate) if os.access(candidate, os.X_OK) else "/bin/true"
    path = tmp_path / UNIT.name
    path.write_text(UNIT.read_text().replace(INSTALLED_CLI, exe))
    return path


def test_systemd_analyze_verify_and_security(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "STOCKADE_SYSTEMD_ANALYZE")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    path = _local_copy(tmp_path)
    proc = subprocess.run([analyze, "verify", "--man=no", f"./{path.name}"], cwd=tmp_path,
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"})
    assert proc.returncode == 0 and path.name not in proc.stderr, proc.stderr
    proc = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", f"--threshold={EXPOSURE_MAX}",
         path.name], cwd=tmp_path, capture_output=True, text=True, check=False)
    if "Unknown command verb" in proc.stderr or "unrecognized option" in proc.stderr:
        pytest.skip("systemd-analyze security --offline needs systemd >= 250")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "Overall exposure level for stockade-launcher.service" in proc.stdout
