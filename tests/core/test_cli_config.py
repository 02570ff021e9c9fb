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
    "sandbox list": ["sandbox", "list"],
    "sandbox kill": ["sandbox", "kill", "t-1"],
    "sandbox suspend": ["sandbox", "suspend", "t-1"],
    "sandbox resume": ["sandbox", "resume", "t-1"],
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


def test_command_line_overrides_win_where_given(tmp_path: Path) -> None:
    from stockade.cli import CommandFailed, config_or_fail

    cfg = tmp_path / "stockade.yaml"
    cfg.write_text("rules_dir: from-file\nbroker: {listen: '127.0.0.1:1'}\n")
    kept = config_or_fail(str(cfg), "broker", rules_dir=None, broker={"listen": None})
    assert (kept.rules_dir, kept.broker.listen) == ("from-file", "127.0.0.1:1")
    over = config_or_fail(str(cfg), "broker", rules_dir="r", broker={"listen": "127.0.0.1:2"})
    assert (over.rules_dir, over.broker.listen) == ("r", "127.0.0.1:2")
    assert over.broker.model_dump(exclude={"listen"}) == kept.broker.model_dump(exclude={"listen"})
    with pytest.raises(CommandFailed) as failed:
        config_or_fail(str(tmp_path / "missing.yaml"), "broker")
    assert failed.value.code == 2 and failed.value.message.startswith("stockade broker: ")
