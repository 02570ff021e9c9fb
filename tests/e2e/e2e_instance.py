"""A self-contained instance's stockade.yaml for e2e tests: everything under one temp
root, the listeners laid out from one base_port, host-wide names unique per test."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from polling import eventually

from stockade.instance import PORT_SPAN
from stockade.ports import free_port_block

PROFILE = """\
profile: e2e
description: end-to-end test - one allowed site, one inspected site, the demo API
isolation: container
limits: {memory: 256MiB, pids: 64, ttl: 90s}
egress:
  allow:
    - host: allowed.test
      ports: [443]
      reason: the one site this task needs
    - host: echo.test
      ports: [443]
      reason: read-only, decided per request by the gateway's L7 inspector
      http: {methods: [GET], paths: ["/echo"]}
broker:
  apis:
    demo-api:
      operations:
        - {method: GET, path: "/v1/whoami"}
"""
API = """\
api: demo-api
description: the fake internet's API; its key is only in the dev OpenBao
base_url: https://api.test
credential: {mount: secret, path: stockade/demo-api, field: token}
inject: {style: bearer}
"""


_TAKEN: set[tuple[str, int]] = set()  # (what, value) handed to an instance of this process


def _unused(what: str, choices: int) -> int:
    """A value in 0..choices-1 no earlier instance of this process was given: two instances
    side by side on one /24 (1 in 250 when drawn freely) route each other's sandboxes'
    packets to the wrong veth, and every fence probe times out."""
    while (what, n := secrets.randbelow(choices)) in _TAKEN:
        pass
    _TAKEN.add((what, n))
    return n


def instance_config(root: Path, inet: Any, **extra: Any) -> dict[str, Any]:
    """run_dir, base_port, state/log dirs and the launcher's host-wide names; the fake
    internet's CA as the one upstream CA (gateway inspection and broker)."""
    rules = root / "rules"
    (rules / "profiles").mkdir(parents=True, exist_ok=True)
    (rules / "apis").mkdir(parents=True, exist_ok=True)
    (rules / "profiles" / "e2e.yaml").write_text(PROFILE)
    (rules / "apis" / "demo-api.yaml").write_text(API)
    sfx = secrets.token_hex(3)
    data: dict[str, Any] = {
        "rules_dir": str(rules),
        "run_dir": str(root / "run"),
        "state_dir": str(root / "state"),
        "log_dir": str(root / "log"),
        "base_port": free_port_block(PORT_SPAN),
        "upstream_ca_file": str(inet.ca_pem),
        "gateway": {"resolvers": [inet.dns_server], "allow_addresses": [inet.subnet]},
        "launcher": {
            "nft_table": f"stockade_i{sfx}",
            "name_prefix": f"i{sfx[:3]}",
            "cgroup_parent": f"stockade_i{sfx}",
            "scratch_dir": str(root / "sbx"),
            "address_pool": f"10.215.{_unused('pool', 250)}.0/24",
            "nflog_group": 7300 + _unused("nflog", 99),
        },
    }
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def write_config(root: Path, data: dict[str, Any]) -> Path:
    path = root / "stockade.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_argv(cfg: Path, *cmd: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "stockade", "run", "--config", str(cfg), "--profile", "e2e",
            "--json", *extra, "--", *cmd]


FORKED = ("stk-keeper", "stk-gateway", "stk-broker")


def forked_stack_procs(marker: str, comms: tuple[str, ...] = FORKED) -> dict[int, str]:
    """Processes the stack forked (stockade/stack/prefork.py: `ps -o comm` stk-keeper,
    stk-gateway, stk-broker; their command line is the starting run's, which names this
    instance's files): {pid: comm}."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm = (d / "comm").read_text().strip()
            args = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if comm in comms and marker in args:
            out[int(d.name)] = comm
    return out


def stockade_procs(marker: str) -> dict[int, str]:
    """Processes (services, keeper) whose command line names this instance's files:
    {pid: command line} (-ww: never cut at a COLUMNS width)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True,
                         check=False).stdout
    procs = (line.strip().partition(" ") for line in out.splitlines())
    found = {int(pid): args for pid, _, args in procs if marker in args and "stockade" in args}
    return found | forked_stack_procs(marker)


def up_ready(up: subprocess.Popen[bytes], err: Path, timeout: float = 120) -> str:
    """`stockade up`'s stderr (the file `err`) once it says it is ready, asserting that it
    did and is still running."""
    assert eventually(lambda: "ready (Ctrl-C" in err.read_text() or up.poll() is not None,
                      timeout, 0.1), err.read_text()
    assert up.poll() is None, err.read_text()
    return err.read_text()
