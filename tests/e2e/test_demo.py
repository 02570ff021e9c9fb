"""The README's main job, end to end: `stockade demo` on real namespaces, nftables,
OpenBao, gateway and broker processes. It must pass and leave nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from e2e_leftovers import new_since, snapshot

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]

# the demo's launcher prefix ("skd"), its nft table, its fake internet ("skfi")
PREFIXES = ("skd", "stockade_demo_", "skfi")


@pytest.mark.timeout(600)
def test_demo_passes_and_cleans_up(netns_available):
    before = snapshot(PREFIXES, "stockade_demo", "stockade-demo-")
    proc = subprocess.run(
        [sys.executable, "-m", "stockade", "demo", "--json"],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["ok"] is True
    steps = {s["step"]: s for s in result["steps"]}
    assert steps["pip_install"]["observed"] == "installed"
    assert steps["broker_call"]["observed"] == "ok"
    for key in ("exfil_https", "exfil_ip_literal", "exfil_dns_tunnel", "exfil_udp", "api_direct"):
        assert steps[key]["observed"] == "blocked", steps[key]
        assert steps[key]["reported"] != "NO", steps[key]
    for key in ("key_in_env", "key_in_files", "key_via_echo", "no_leak"):
        assert steps[key]["observed"] == "not found", steps[key]
    # every denial carries this task and a stable reason code
    assert result["denials"]
    for ev in result["denials"]:
        assert ev["labels"]["task_id"] == result["task_id"]
        assert ev["event"]["reason"]
    assert new_since(before, snapshot(PREFIXES, "stockade_demo", "stockade-demo-")) == {}


@pytest.mark.timeout(600)
def test_demo_human_summary(netns_available):
    proc = subprocess.run(
        [sys.executable, "-m", "stockade", "demo"],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "expected" in out and "observed" in out
    assert "11 passed, 0 failed" in out
    assert "Denial events for this task" in out
