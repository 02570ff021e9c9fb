"""`stockade run` and `stockade sandbox list|suspend|resume|kill` as real processes."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from stockade.launcher import netns, nft
from stockade.launcher.cgroups import leftover_names

from stockade.config import load_config
from stockade.events import read_events, validate
from stockade.stack.run import _parse_input
from stockade.tasks import TaskRegistry

from .conftest import Lab, control_server

pytestmark = pytest.mark.netns

PROFILE = """\
profile: cli
description: launcher CLI test
limits: {cpus: 1, memory: 128MiB, disk: 16MiB, pids: 64, ttl: 30s}
egress:
  mode: enforce
exports: {max_file: 1KiB, max_total: 4KiB, types: [text]}
selftest: sampled
"""


def _config_file(lab: Lab, tmp: Path) -> Path:
    p = tmp / "stockade.yaml"
    p.write_text(yaml.safe_dump(lab.config.model_dump()))
    return p


def _stockade(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stockade", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_parse_input() -> None:
    assert _parse_input("/data/x") == ("/data/x", "/inputs/x")
    assert _parse_input("/data/x/:/in") == ("/data/x/", "/in")


def test_run_json(lab: Lab, tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    (rules / "profiles").mkdir(parents=True)
    (rules / "profiles" / "cli.yaml").write_text(PROFILE)
    data = tmp_path / "data.txt"
    data.write_text("input-data")
    cfg = _config_file(lab, tmp_path)
    out = tmp_path / "exported"
    p = _stockade("run", "--profile", "cli", "--rules", str(rules), "--config", str(cfg),
                  "--input", f"{data}:/in/data.txt", "--export", str(out), "--ttl", "20",
                  "--json", "--", "sh", "-c",
                  "cat /in/data.txt; echo note > /scratch/out/n.txt; echo warn >&2; exit 3")
    assert p.returncode == 3, p.stderr
    res = json.loads(p.stdout)
    assert set(res) >= {"task_id", "exit_code", "stdout", "stderr", "duration_s", "denials",
                        "exports", "ended_by"}
    assert (res["stdout"], res["stderr"], res["exit_code"], res["ended_by"]) == (
        "input-data", "warn\n", 3, "exit")
    assert res["exports"] == [{"name": "n.txt", "size": 5, "type": "text"}]
    assert (out / "n.txt").read_text() == "note\n"
    for ev in res["denials"]:
        validate(ev)


def test_run_plain_and_errors(lab: Lab, tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    (rules / "profiles").mkdir(parents=True)
    (rules / "profiles" / "cli.yaml").write_text(PROFILE)
    cfg = _config_file(lab, tmp_path)
    p = _stockade("run", "--profile", "cli", "--rules", str(rules), "--config", str(cfg),
                  "--", "echo", "hello")
    assert (p.returncode, p.stdout) == (0, "hello\n")
    p = _stockade("run", "--profile", "nope", "--rules", str(rules), "--config", str(cfg),
                  "--", "true")
    assert p.returncode == 2 and "unknown profile" in p.stderr
    p = _stockade("run", "--profile", "cli", "--rules", str(rules), "--config", str(cfg))
    assert p.returncode == 2 and "missing command" in p.stderr


def test_sandbox_commands_from_another_process(lab: Lab, tmp_path: Path) -> None:
    cfg = _config_file(lab, tmp_path)
    t, box = lab.background(["sleep", "60"])
    rows = json.loads(_stockade("sandbox", "list", "--json", "--config", str(cfg)).stdout)
    assert len(rows) == 1 and rows[0]["profile"] == "test"
    assert rows[0]["isolation"] == "container"  # the tier it runs at (netns backend)
    tid = rows[0]["task_id"]
    table = _stockade("sandbox", "list", "--config", str(cfg)).stdout
    assert tid in table and "running" in table
    assert table.split("\n")[0].split() == ["TASK", "PROFILE", "ADDRESS", "ISOLATION", "STATE"]
    assert table.split("\n")[1].split()[3:] == ["container", "running"]
    assert _stockade("sandbox", "suspend", tid, "--config", str(cfg)).returncode == 0
    assert lab.launcher.list()[0]["state"] == "frozen"
    assert _stockade("sandbox", "resume", tid, "--config", str(cfg)).returncode == 0
    assert _stockade("sandbox", "kill", tid, "--config", str(cfg)).returncode == 0
    t.join(timeout=20)
    assert box["result"].ended_by == "killed"
    p = _stockade("sandbox", "kill", tid, "--config", str(cfg))
    assert p.returncode == 1 and "no sandbox" in p.stderr


def test_run_refuses_a_stronger_isolation_and_names_the_way_out(
    lab: Lab, tmp_path: Path
) -> None:
    """A tier this host cannot give (gvisor with runsc missing; microvm with its backend disabled)
    is refused at once with the way out, and with the downgrade configured it runs (at
    container grade)."""
    rules = tmp_path / "rules"
    (rules / "profiles").mkdir(parents=True)
    (rules / "profiles" / "gv.yaml").write_text(
        PROFILE.replace("profile: cli", "profile: gv") + "isolation: gvisor\n")
    (rules / "profiles" / "vm.yaml").write_text(
        PROFILE.replace("profile: cli", "profile: vm") + "isolation: microvm\n")
    cfg = _config_file(lab, tmp_path)
    data = lab.config.model_dump()
    data["launcher"]["microvm"]["enabled"] = False
    data["launcher"]["gvisor"]["runsc"] = "/nonexistent/runsc"
    cfg.write_text(yaml.safe_dump(data))
    for name, why in (("gv", "runsc (/nonexistent/runsc) is not installed"),
                      ("vm", "launcher.microvm.enabled is false")):
        p = _stockade("run", "--profile", name, "--rules", str(rules), "--config", str(cfg),
                      "--", "true")
        assert p.returncode == 2, p.stderr
        assert f"asks for isolation '{'gvisor' if name == 'gv' else 'microvm'}'" in p.stderr
        assert why in p.stderr and "launcher.downgrade_isolation" in p.stderr
    data["launcher"]["downgrade_isolation"] = ["gvisor"]
    cfg.write_text(yaml.safe_dump(data))
    p = _stockade("run", "--profile", "gv", "--rules", str(rules), "--config", str(cfg),
                  "--json", "--", "echo", "ran")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["stdout"] == "ran\n"


def _own_launcher_config(lab: Lab, tmp: Path, state_dir: Path, **config: Any) -> Path:
    """The lab's services, but a launcher of its own (table, names, cgroups, scratch,
    addresses): its start-up reconcile and close must not touch the lab's launcher."""
    sfx = secrets.token_hex(2)
    launcher = lab.config.launcher.model_copy(update={
        "nft_table": f"stockade_fd{sfx}", "name_prefix": f"f{sfx[:3]}",
        "cgroup_parent": f"stockade_fd{sfx}", "scratch_dir": str(tmp / "sbx"),
        "address_pool": f"10.214.{100 + secrets.randbelow(100)}.0/24"})
    cfg = lab.config.model_copy(update={"state_dir": str(state_dir), "launcher": launcher,
                                        **config})
    p = tmp / f"stockade-{sfx}.yaml"
    p.write_text(yaml.safe_dump(cfg.model_dump()))
    return p


def _nothing_left(cfg_path: Path) -> dict[str, Any]:
    s = load_config(cfg_path).launcher
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
              if line.split()[1].startswith(s.scratch_dir)]
    return {"netns": netns.list_netns(s.name_prefix), "links": netns.list_links(s.name_prefix),
            "cgroups": sorted(leftover_names(s.cgroup_root, s.cgroup_parent)),
            "scratch": sorted(os.listdir(s.scratch_dir)) if os.path.isdir(s.scratch_dir) else [],
            "mounts": mounts, "table": nft.table_exists(s.nft_table)}


NOTHING = {"netns": [], "links": [], "cgroups": [], "scratch": [], "mounts": [], "table": False}


def test_run_on_a_full_state_disk(lab: Lab, tmp_path: Path, full_disk: Any) -> None:
    """A full state disk: `stockade run` says so and exits 2, no traceback, nothing left;
    also when it is the gateway's registry that cannot be written (a JSON 507)."""
    rules = tmp_path / "rules"
    (rules / "profiles").mkdir(parents=True)
    (rules / "profiles" / "cli.yaml").write_text(PROFILE)
    disk = full_disk("state")
    disk.fill()
    cfg = _own_launcher_config(lab, tmp_path, disk.path)
    p = _stockade("run", "--profile", "cli", "--rules", str(rules), "--config", str(cfg),
                  "--", "echo", "hello")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert "cannot write the launcher state" in p.stderr
    assert "No space left on device" in p.stderr
    assert _nothing_left(cfg) == NOTHING

    # the launcher's state has room; the gateway's registry does not
    registry = TaskRegistry(disk.path / "gateway-tasks.json")
    sock = tmp_path / "full-gateway.sock"
    with control_server(registry, sock):
        gateway = lab.config.gateway.model_copy(update={"control_socket": str(sock)})
        cfg = _own_launcher_config(lab, tmp_path, tmp_path / "state-ok", gateway=gateway)
        p = _stockade("run", "--profile", "cli", "--rules", str(rules), "--config", str(cfg),
                      "--", "echo", "hello")
        assert p.returncode == 2, p.stderr
        assert "Traceback" not in p.stderr and p.stdout == ""
        assert "507 state_write_failed: No space left on device" in p.stderr, p.stderr
        assert _nothing_left(cfg) == NOTHING
        assert len(registry) == 0 and lab.broker_registry.tasks() == []
        assert json.loads((tmp_path / "state-ok" / "launcher" /
                           f"{load_config(cfg).launcher.nft_table}.json").read_text()) == {
            "sandboxes": []}


def test_run_picks_the_backend_from_the_profile(lab: Lab, tmp_path: Path) -> None:
    """`stockade run --profile X`: a gvisor profile runs under runsc (its start event says
    so, with the platform and network), a container one in the netns backend."""
    from stockade.launcher.backends.gvisor import BACKEND

    why = BACKEND.problem(lab.config.launcher)
    if why is not None:
        pytest.skip(f"gVisor unavailable: {why}")
    rules = tmp_path / "rules"
    (rules / "profiles").mkdir(parents=True)
    (rules / "profiles" / "gv.yaml").write_text(
        PROFILE.replace("profile: cli", "profile: gv") + "isolation: gvisor\n")
    (rules / "profiles" / "cli.yaml").write_text(PROFILE)
    cfg = _config_file(lab, tmp_path)
    tiers = {}
    for name in ("gv", "cli"):
        p = _stockade("run", "--profile", name, "--rules", str(rules), "--config", str(cfg),
                      "--json", "--", "echo", "ran")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["stdout"] == "ran\n"
        start = next(e for e in read_events(lab.config.events_file)
                     if e.get("labels", {}).get("task_id") == out["task_id"])["stockade"]
        tiers[name] = (start["isolation"], start.get("gvisor"))
    assert tiers["gv"] == ("gvisor", BACKEND.runtime(lab.config.launcher))
    assert tiers["cli"] == ("container", None)
