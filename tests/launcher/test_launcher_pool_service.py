"""Warm pools kept by the launcher service (`stockade launcher serve`, as `stockade up`
runs it): its health and `stockade sandbox list` show them, `stockade run` against a
running stack with pools claims from the service's pool, so does a session
(POST /v1/sessions), and stopping the service leaves no pooled sandbox behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import eventually

from stockade.tasks.client import _UnixHTTPConnection

from .conftest import Lab
from .sessions_rig import Api
from .test_launcher_service import Served, _serve

pytestmark = pytest.mark.netns

SIZE = 2
# the limits of test_launcher_service.py's `svc` profile
POOLS = {"targets": [{"isolation": "container", "size": SIZE, "cpus": 1, "memory_mib": 128,
                      "disk_mib": 16, "pids": 64}]}


@pytest.fixture
def pooled_service(lab: Lab, tmp_path: Path) -> Iterator[Served]:
    yield from _serve(lab, tmp_path, pools=POOLS)


def _ready(served: Served) -> int:
    rows = served.client.health()["pools"]
    assert len(rows) == 1 and rows[0]["target"] == SIZE, rows
    return int(rows[0]["ready"])


def _stockade(served: Served, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stockade", *args, "--config",
                           str(served.cfg_path)], capture_output=True, text=True, timeout=120)


def test_run_claims_from_the_services_pool(pooled_service: Served) -> None:
    served = pooled_service
    assert eventually(lambda: _ready(served) == SIZE, 120), served.err.read_text()
    pooled = {r["task_id"] for r in served.client.list() if r["state"] == "pooled"}
    assert len(pooled) == SIZE
    listed = _stockade(served, "sandbox", "list")
    assert f"pool netns/cpus=1,mem=128Mi,disk=16Mi,pids=64: {SIZE} ready" in listed.stdout, (
        listed.stdout, listed.stderr)
    p = subprocess.run([sys.executable, "-m", "stockade", "run", "--profile", "svc",
                        "--config", str(served.cfg_path), "--json", "--", "sh", "-c",
                        "echo hello; id -u"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["stdout"].split() == ["hello", "65534"], res
    assert res["task_id"] in pooled, "the run claimed a sandbox of the service's pool"
    assert served.client.health()["pools"][0]["claims"] == 1
    conn = _UnixHTTPConnection(served.config.launcher.control_socket, 10)
    conn.request("GET", "/v1/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    label = 'pool="netns/cpus=1,mem=128Mi,disk=16Mi,pids=64"'
    assert f"stockade_launcher_pool_claims_total{{{label}}} 1.0" in text, text
    assert f"stockade_launcher_pool_target{{{label}}} {float(SIZE)}" in text, text
    assert eventually(lambda: _ready(served) == SIZE, 120)
    assert res["task_id"] not in {r["task_id"] for r in served.client.list()}


def test_stopping_the_service_removes_its_pool(pooled_service: Served) -> None:
    served = pooled_service
    assert eventually(lambda: _ready(served) == SIZE, 120), served.err.read_text()
    s = served.config.launcher
    assert served.stop() == 0, served.err.read_text()
    state = Path(served.config.state_dir) / "launcher" / f"{s.nft_table}.json"
    records = json.loads(state.read_text())["sandboxes"] if state.exists() else []
    assert records == []
    assert not list(Path("/run/netns").glob(f"{s.name_prefix}-*"))
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert s.nft_table not in tables


def _netns_of(served: Served, task_id: str) -> str | None:
    """The sandbox's network namespace name in the service's state file."""
    state = Path(served.config.state_dir) / "launcher" / f"{served.config.launcher.nft_table}.json"
    for rec in json.loads(state.read_text())["sandboxes"] if state.exists() else []:
        if rec["task_id"] == task_id:
            return str(rec["netns"])
    return None


def test_a_session_claims_a_pooled_sandbox(pooled_service: Served) -> None:
    """POST /v1/sessions takes a warm sandbox of the service's pool; its execs run in that
    sandbox (its network namespace, as the sandbox user); DELETE destroys it and the pool
    is refilled with a new one."""
    served = pooled_service
    api = Api(served.config.launcher.control_socket)
    assert eventually(lambda: _ready(served) == SIZE, 120), served.err.read_text()
    pooled = {r["task_id"] for r in served.client.list() if r["state"] == "pooled"}
    sid = api.create("svc")["session_id"]
    assert sid in pooled, "the session claimed a sandbox of the service's pool"
    assert served.client.health()["pools"][0]["claims"] == 1
    ns = _netns_of(served, sid)
    assert ns is not None
    r = api.exec(sid, ["sh", "-c", "id -u; readlink /proc/self/ns/net; echo kept > f"])
    assert r["exit_code"] == 0, r
    uid, net = r["stdout"].split()
    assert uid == "65534"
    assert net == f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]", "the exec ran in the claim"
    assert api.exec(sid, ["cat", "f"])["stdout"] == "kept\n"
    killed = api.call("DELETE", f"/v1/sessions/{sid}")
    assert (killed.status, killed.json()) == (200, {"killed": True})
    assert eventually(lambda: sid not in {r["task_id"] for r in served.client.list()}, 60)
    assert not os.path.exists(f"/run/netns/{ns}")
    assert eventually(lambda: _ready(served) == SIZE, 120), "the pool was refilled"
    assert sid not in {r["task_id"] for r in served.client.list()}
