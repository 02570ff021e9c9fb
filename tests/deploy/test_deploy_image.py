"""deploy/image: the OCI image, built from Debian packages (deploy/image/build.sh: mmdebstrap
from the Debian mirror, no registry pull) and run with rootful podman: its CLI, the shipped
rules, and one container-tier sandbox started inside the image, in a network namespace this
test owns, whose fence holds (a direct connection is redirected to the gateway and denied).

The build reuses what an earlier one cached (the base rootfs, the wheels, the image of the
same inputs): the first build on a host takes a few minutes, a repeat seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_support import DEPLOY, REPO, parse_unit, unit_value

pytestmark = [pytest.mark.image, pytest.mark.netns, pytest.mark.slow]

BUILD = DEPLOY / "image" / "build.sh"
LAUNCHER_UNIT = DEPLOY / "systemd" / "stockade-launcher.service"
# crun refuses this host's hybrid cgroups; podman's default ulimits are refused there too
RUN = ["podman", "run", "--rm", "--runtime", "runc",
       "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]

PROFILE = """\
profile: image-test
description: the image test - a sandbox that may reach nothing
isolation: container
limits: {memory: 256MiB, pids: 64, ttl: 60s}
egress:
  mode: enforce
"""

PROBE = """\
import os, socket
print("uid", os.getuid())
s = socket.socket()
s.settimeout(10)
try:
    s.connect(("192.0.2.1", 80))
    s.sendall(b"GET / HTTP/1.1\\r\\nHost: example.com\\r\\n\\r\\n")
    print("answer", s.recv(200).split(b"\\r\\n")[0].decode())
except OSError as e:
    print("blocked", type(e).__name__)
"""


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (rootful podman, mmdebstrap, network namespaces)"
    for tool in ("podman", "mmdebstrap", "runc", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/bootstrap.sh installs it)"
    return None


@pytest.fixture(scope="module")
def image() -> str:
    why = _missing()
    if why:
        pytest.skip(why)
    proc = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, check=False,
                          timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = proc.stdout.strip().splitlines()[-1]
    assert ref.startswith("localhost/stockade:")
    return ref


@pytest.fixture
def netns() -> Iterator[str]:
    name = "stkimg" + uuid.uuid4().hex[:8]
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def run(image: str, *argv: str, opts: tuple[str, ...] = ("--network", "none"),
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`podman run` of `image`; by default without a network (no bridge, no host rules)."""
    return subprocess.run([*RUN, *opts, image, *argv], capture_output=True, text=True,
                          check=False, timeout=timeout)


@pytest.mark.timeout(3600)
def test_cli_version_and_the_shipped_rules(image: str) -> None:
    from importlib.metadata import version

    proc = run(image, "stockade", "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"stockade {version('stockade')}"
    proc = run(image, "stockade", "rules", "lint", "/etc/stockade/rules")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 error(s)" in proc.stdout + proc.stderr
    # the image's rules are the repository's, and every tier's tools are there
    proc = run(image, "sh", "-c", "cd /etc/stockade/rules && find . -type f | sort; "
               "for t in runsc qemu-system-x86_64 bao nft ip; do command -v $t; done; "
               # no socket bridge to copy the launcher's API to an open port
               "if command -v socat; then exit 3; fi; "
               "test -f /var/cache/stockade/vm/manifest.json && echo guest-image")
    assert proc.returncode == 0, proc.stderr
    shipped = sorted("./" + str(p.relative_to(REPO / "rules"))
                     for p in (REPO / "rules").rglob("*") if p.is_file())
    lines = proc.stdout.splitlines()
    assert lines[:len(shipped)] == shipped
    assert [Path(p).name for p in lines[len(shipped):-1]] == [
        "runsc", "qemu-system-x86_64", "bao", "nft", "ip"]
    assert lines[-1] == "guest-image"


@pytest.mark.timeout(3600)
def test_a_container_tier_sandbox_inside_the_image(image: str, netns: str, tmp_path: Path
                                                   ) -> None:
    tag = uuid.uuid4().hex[:6]
    (tmp_path / "rules" / "profiles").mkdir(parents=True)
    (tmp_path / "rules" / "profiles" / "image-test.yaml").write_text(PROFILE)
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "stockade.yaml").write_text(json.dumps({
        "rules_dir": "/work/rules", "state_dir": "/tmp/stk/state", "run_dir": "/tmp/stk/run",
        "log_dir": "/tmp/stk/log",
        # the profile has no rule that needs L7 inspection: no mitmproxy child to wait for
        "gateway": {"inspection": {"enabled": False}},
        "launcher": {"name_prefix": "skimg", "nft_table": f"stockade_img_{tag}",
                     "cgroup_parent": f"stockade_img_{tag}",
                     "scratch_dir": "/tmp/stk/sandboxes",
                     # the container's hard RLIMIT_NOFILE (--ulimit above)
                     "rlimit_nofile": 1024},
    }))
    caps = (unit_value(parse_unit(LAUNCHER_UNIT), "Service", "CapabilityBoundingSet") or ""
            ).split()
    opts = (
        "--network", f"ns:/run/netns/{netns}",
        # the launcher unit's capabilities, nothing else (as the Helm chart's launcher);
        # /proc/sys stays as podman mounts it, read-only: the launcher writes the
        # sandbox's sysctls through a procfs of its own; the node's cgroups
        "--cap-drop", "all", "--cap-add", ",".join(c.removeprefix("CAP_") for c in caps),
        "-v", "/sys/fs/cgroup:/sys/fs/cgroup", "-v", f"{tmp_path}:/work:ro",
    )
    # as in a pod: /proc/sys is read-only for root in the container
    proc = run(image, "sh", "-c", "test ! -w /proc/sys/net/ipv4/ping_group_range && "
               "grep -E '^proc /proc/sys proc ro,' /proc/mounts", opts=opts)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run(image, "stockade", "run", "--config", "/work/stockade.yaml", "--profile",
               "image-test", "--input", "/work/probe.py:/input/probe.py", "--json", "--",
               "python3", "/input/probe.py", opts=opts)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exit_code"] == 0 and result["ended_by"] == "exit", result
    assert result["stdout"].splitlines()[0] == "uid 65534"
    # the direct connection went to the gateway, which refused it
    assert "403 Forbidden" in result["stdout"], result["stdout"]
    denial = result["denials"][0]
    assert denial["event"]["reason"] == "no_matching_rule"
    assert denial["stockade"]["original_destination"] == "192.0.2.1:80"
    assert denial["labels"]["task_id"] == result["task_id"]
    # nothing of the sandbox is left in the test's namespace
    links = subprocess.run(["ip", "-n", netns, "-o", "link"], capture_output=True, text=True,
                           check=True).stdout
    assert "skimg" not in links
