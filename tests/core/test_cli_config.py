"""Every command that reads stockade.yaml answers an unusable one the same way: one line
`stockade NAME: <the ConfigError>` on stderr and exit 2, before doing anything else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stockade.config import ConfigError, load_config

COMMANDS = {
    "gateway": ["gateway", "serve", "--no-dns"],
    "broker": ["broker", "serve"],
    "launcher": ["launcher", "serve"],
    "up": ["up"],
    "events": ["events"],
    "run": ["run", "--profile", "p", "--", "true"],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_unusable_config_exits_2_with_one_line(tmp_path: Path, name: str) -> None:
    cfg = tmp_path / "stockade.yaml"
    cfg.write_text("nonsense_key: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    argv = COMMANDS[name]
    # --config goes before a trailing `-- CMD`
    argv = [*argv[:-2], "--config", str(cfg), *argv[-2:]] if "--" in argv else [
        *argv, "--config", str(cfg)]
    r = subprocess.run(
        [sys.executable, "-m", "stockade", *argv], capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stderr) == (2, f"stockade {name}: {err.value}\n")
