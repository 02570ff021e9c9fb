"""`stockade run --json` on embedded defaults against the fake internet: the stack
(gateway, broker, dev OpenBao) starts for the run, the sandbox's denials come back with
its task id and stable reason codes, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from e2e_leftovers import new_since, snapshot
from gw_config import write_profiles

from stockade.stack.demo import demo_config

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]

PROFILE = """\
profile: e2e
description: end-to-end test - one allowed site
limits: {memory: 256MiB, pids: 64, ttl: 60s}
egress:
  allow:
    - host: allowed.test
      ports: [443]
      id: e2e-allowed
      reason: the one site this task needs
"""

UDP_PROBE = """\
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
try:
    s.sendto(b"x", (sys.argv[1], int(sys.argv[2])))
    s.recvfrom(100)
    print("udp reached")
except OSError as e:
    print("udp blocked", type(e).__name__)
"""


@pytest.fixture
def run_config(tmp_path: Path, fake_internet) -> Path:
    rules = write_profiles(tmp_path / "rules", {"e2e": PROFILE})
    cfg = demo_config(tmp_path / "root", fake_internet)
    cfg = cfg.model_copy(
        update={
            "rules_dir": str(rules),
            "launcher": cfg.launcher.model_copy(
                update={
                    "name_prefix": "ske",
                    "nft_table": "stockade_e2e_run",
                    "cgroup_parent": "stockade_e2e_run",
                }
            ),
        }
    )
    path = tmp_path / "stockade.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


@pytest.mark.timeout(300)
def test_run_json_reports_denials_with_task_and_reasons(run_config, fake_internet, tmp_path):
    inet = fake_internet
    probe = tmp_path / "udp_probe.py"
    probe.write_text(UDP_PROBE)
    probe.chmod(0o644)
    denied_ip = inet.addresses["denied.test"]
    udp_ip, udp_port = inet.udp_echo
    script = (
        "curl -s --max-time 10 --cacert /input/ca.pem https://allowed.test/ ; echo;"
        'curl -s --max-time 10 --cacert /input/ca.pem https://denied.test/ ; echo "rc=$?";'
        f"curl -s -D - --max-time 10 http://{denied_ip}/ ; echo;"
        f"python3 /input/udp_probe.py {udp_ip} {udp_port}"
    )
    before = snapshot(("ske", "stockade_e2e_run"), "stockade_e2e_run", str(run_config.parent))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stockade",
            "run",
            "--config",
            str(run_config),
            "--profile",
            "e2e",
            "--json",
            "--input",
            f"{inet.ca_pem}:/input/ca.pem",
            "--input",
            f"{probe}:/input/udp_probe.py",
            "--",
            "sh",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.stdout, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["ended_by"] == "exit"
    assert result["exit_code"] == 0, result
    out = result["stdout"]
    assert "allowed.test" in out  # the allowed site's page came through the gateway
    assert "X-Stockade-Deny: no_matching_rule" in out  # the IP literal got a legible 403
    assert "udp blocked" in out
    task = result["task_id"]
    denials = result["denials"]
    assert denials and all(ev["labels"]["task_id"] == task for ev in denials)
    by_action: dict[str, set[str]] = {}
    for ev in denials:
        by_action.setdefault(ev["event"]["action"], set()).add(ev["event"]["reason"])
    assert "no_matching_rule" in by_action.get("dns_decision", set())  # denied.test lookup
    assert "no_matching_rule" in by_action.get("connection_decision", set())  # IP literal
    assert "bypass_attempt" in by_action.get("bypass_attempt", set())  # UDP
    after = snapshot(("ske", "stockade_e2e_run"), "stockade_e2e_run", str(run_config.parent))
    assert new_since(before, after) == {}


ONLY_IN_DIR = PROFILE + """\
    - host: other.test
      ports: [443]
      id: e2e-other
      reason: allowed only by the rules directory given with --rules
"""


@pytest.mark.timeout(300)
def test_rules_dir_given_with_rules_is_the_gateways(run_config, fake_internet, tmp_path):
    """`--rules DIR` on an embedded stack: the gateway it starts decides with DIR (a rule
    only there lets the flow through), not with the config's rules_dir."""
    rules = write_profiles(tmp_path / "other-rules", {"e2e": ONLY_IN_DIR})
    script = ("curl -s -o /dev/null -w 'code=%{http_code}' --max-time 10 "
              "--cacert /input/ca.pem https://other.test/")
    proc = subprocess.run(
        [sys.executable, "-m", "stockade", "run", "--config", str(run_config),
         "--rules", str(rules), "--profile", "e2e", "--json",
         "--input", f"{fake_internet.ca_pem}:/input/ca.pem", "--", "sh", "-c", script],
        capture_output=True, text=True, timeout=240, check=False)
    assert proc.stdout, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["stdout"] == "code=200", result
    assert not [d for d in result["denials"] if "other.test" in json.dumps(d)], result


@pytest.mark.timeout(300)
def test_rules_without_broker_grants_start_no_openbao(run_config, tmp_path):
    """The run's rules grant no broker API: its stack is gateway and broker only (the
    keeper's state says no dev Vault while the command runs)."""
    cfg = yaml.safe_load(run_config.read_text())
    cfg.pop("dev_vault")  # left to the defaults (the fixture writes every key out)
    config = tmp_path / "defaults-vault.yaml"
    config.write_text(yaml.safe_dump(cfg))
    state = Path(cfg["run_dir"]) / "stack.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stockade", "run", "--config", str(config), "--profile",
         "e2e", "--", "sleep", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = None
    while proc.poll() is None and seen is None:
        try:
            seen = json.loads(state.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert seen is not None and seen["dev_vault"] is False, seen
    assert "starting the stack (gateway, broker)" in err, err
