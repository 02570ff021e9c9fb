"""`stockade run` for a person at the terminal: progress lines on stderr while the stack
starts and the sandbox is set up, the command's own output untouched, and a closing
denial summary counted by reason and destination; `--json` prints none of it."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from gw_config import write_profiles

from stockade.stack.demo import demo_config

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]

PROFILE = """\
profile: term
description: terminal output test - nothing allowed
limits: {memory: 256MiB, pids: 64, ttl: 60s}
egress:
  allow: []
"""


@pytest.fixture
def run_config(tmp_path: Path, fake_internet) -> Path:
    rules = write_profiles(tmp_path / "rules", {"term": PROFILE})
    cfg = demo_config(tmp_path / "root", fake_internet)
    sfx = secrets.token_hex(3)  # other worktrees run this suite at the same time
    cfg = cfg.model_copy(update={"rules_dir": str(rules), "launcher": cfg.launcher.model_copy(
        update={"name_prefix": f"t{sfx[:3]}", "nft_table": f"stockade_tm{sfx}",
                "cgroup_parent": f"stockade_tm{sfx}"})})
    path = tmp_path / "stockade.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _run(cfg: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    script = ("echo out-line; echo err-line >&2; "
              "for i in 1 2; do getent hosts denied.test || echo lookup-refused; done")
    return subprocess.run(
        [sys.executable, "-m", "stockade", "run", "--config", str(cfg), "--profile", "term",
         *extra, "--", "sh", "-c", script],
        capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.timeout(600)
def test_progress_and_denial_summary(run_config: Path):
    proc = _run(run_config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "out-line\nlookup-refused\nlookup-refused\n"
    lines = proc.stderr.splitlines()
    assert lines[0] == "stockade run: joining or starting the stack (gateway, broker, OpenBao)…"
    assert lines[1].startswith("stockade run: stack ready (")
    started = re.compile(r"stockade run: sandbox [0-9a-f]{10} ready at container grade "
                         r"\([\d.]+ s\); running the command\Z")
    assert any(started.match(ln) for ln in lines), lines
    assert "err-line" in lines
    at = lines.index(next(ln for ln in lines if ln.endswith(" denials:")))
    n = int(lines[at].split()[2])
    assert n >= 2  # two refused lookups (each may be tried for A and AAAA)
    rows = lines[at + 1:]
    assert rows and all(r.startswith("stockade run:   ") for r in rows)
    assert any("no_matching_rule  denied.test" in r for r in rows), rows
    assert sum(int(r.split()[2].rstrip("x")) for r in rows) == n

    quiet = _run(run_config, "--json")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    result = json.loads(quiet.stdout)
    assert result["stdout"] == proc.stdout and result["denials"]
    assert "stockade run:" not in quiet.stderr  # --json: no progress, no summary
