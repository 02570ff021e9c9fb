"""`stockade up`: gateway, broker, the launcher's control service and a dev OpenBao as
separate processes, a status line per component, usable by `stockade run` and through the
launcher's socket, and a clean Ctrl-C that leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from e2e_instance import up_ready
from e2e_leftovers import new_since, snapshot
from stockade.launcher import SandboxSpec
from stockade.launcher.service import LauncherClient

from stockade.config import load_config
from stockade.stack.demo import demo_config
from stockade.stack.services import stack_running

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_up_runs_the_stack_and_stops_cleanly_on_ctrl_c(tmp_path: Path, fake_internet):
    cfg = demo_config(tmp_path / "root", fake_internet)
    cfg_path = tmp_path / "stockade.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    marker = str(cfg.run_dir)
    # the launcher service's nft table too: it must be gone after Ctrl-C
    prefixes = ("skd", cfg.launcher.nft_table)
    before = snapshot(prefixes, "stockade_demo", marker)
    err = tmp_path / "up.err"
    with open(err, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stockade", "up", "--config", str(cfg_path)],
            stdout=subprocess.DEVNULL,
            stderr=fh,
            start_new_session=True,
        )
    try:
        text = up_ready(proc, err)
        for component in ("openbao (dev)", "gateway", "broker", "launcher"):
            assert f"stockade up: {component}" in text, text
        assert any(
            line.startswith("stockade up: launcher") and line.endswith("ready")
            for line in text.splitlines()
        ), text
        assert stack_running(load_config(cfg_path))
        # a second `up` on the same sockets refuses instead of fighting the first
        second = subprocess.run(
            [sys.executable, "-m", "stockade", "up", "--config", str(cfg_path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert second.returncode == 1 and "already running" in second.stderr
        # run on top of the running stack: no second gateway is started
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "stockade",
                "run",
                "--config",
                str(cfg_path),
                "--profile",
                "demo",
                "--json",
                "--",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        # an orchestrator's sandbox through the launcher's socket
        client = LauncherClient(cfg.launcher.control_socket, timeout=30)
        res = client.run(SandboxSpec("demo", ["sh", "-c", "echo via-socket"]))
        assert (res.exit_code, res.stdout, res.ended_by) == (0, "via-socket\n", "exit"), res
        # one left running: Ctrl-C must kill it and remove every piece of it
        left = client.start(SandboxSpec("demo", ["sleep", "60"]))
        assert [r["task_id"] for r in client.list()] == [left]
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert proc.wait(timeout=60) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "stopping" in err.read_text()
    assert not stack_running(load_config(cfg_path))
    assert new_since(before, snapshot(("skd",), "stockade_demo", marker)) == {}
    assert not list(Path(cfg.run_dir).glob("*.sock"))
    assert not (Path(cfg.run_dir) / "dev-vault-token").exists()
