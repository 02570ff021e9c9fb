"""Every service refuses to start, with a one-line reason and exit 2, when the event
chain's signing key is unusable: never a traceback, never a half-started service."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("component", ["gateway", "broker", "launcher"])
def test_a_service_with_an_unusable_chain_key_exits_2(tmp_path: Path, component: str) -> None:
    chain = tmp_path / "state" / "events-chain"
    chain.mkdir(parents=True, mode=0o700)
    (chain / "signing.key").write_text("not a key\n")
    cfg = tmp_path / "stockade.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nlog_dir: {tmp_path}/log\n"
                   f"run_dir: {tmp_path}/run\nrules_dir: {ROOT}/rules\n")
    p = subprocess.run([sys.executable, "-m", "stockade", component, "serve", "--config",
                        str(cfg)], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert f"stockade {component}: cannot start: {chain / 'signing.key'}" in p.stderr
