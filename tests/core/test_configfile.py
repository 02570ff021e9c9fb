"""The launcher's short commands read stockade.yaml as `LauncherFile`: the keys they use
validated exactly as `Config` does (the same values, the same error lines), the other
components' sections unread and their models never imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.cli import CommandFailed, config_or_fail
from stockade.config import Config, ConfigError, load_config
from stockade.configfile import LauncherFile, load_as

SHARED = ("rules_dir", "state_dir", "log_dir", "run_dir", "base_port", "upstream_ca_file",
          "events", "launcher")


def _both(p: Path) -> tuple[Config, LauncherFile]:
    return load_config(p), load_as(LauncherFile, p)


def test_the_shared_keys_are_the_same(tmp_path: Path) -> None:
    p = tmp_path / "stockade.yaml"
    p.write_text("state_dir: /tmp/s\nrun_dir: /tmp/r\nbase_port: 20000\n"
                 "events: {file: /tmp/e.jsonl}\n"
                 "launcher: {nft_table: t1, cgroup_parent: p1}\n"
                 "gateway: {allow_addresses: [10.250.0.0/24]}\n")
    full, lean = _both(p)
    for key in SHARED:
        assert getattr(lean, key) == getattr(full, key), key
    assert lean.events_file == full.events_file == Path("/tmp/e.jsonl")
    assert lean.task_events_dir == full.task_events_dir
    # derived from run_dir as in the whole file's model
    assert lean.launcher.control_socket == full.launcher.control_socket == "/tmp/r/launcher.sock"
    assert list(LauncherFile.model_fields) == list(Config.model_fields)


@pytest.mark.parametrize("text", [
    "gatway: {}\n",  # unknown top-level key
    "launcher:\n  nft_table: 5\n  no_such_key: 1\n",
    "events: {stdout: maybe}\n",
    "state_dir: a\nstate_dir: b\n",
    "- a list\n",
    "launcher: [unclosed\n",
    "base_port: 0\n",
    # what configpeek (`sandbox list|kill`) reads: the models decide, with these lines
    "launcher: {nft_tabel: t}\n",
    "launcher: {cgroup_parent: 'a b'}\n",
    "launcher: {selftest: {raw_ip: '::1'}}\n",
    "events: {max_bytes: 0}\n",
    "events: null\n",
])
def test_the_errors_of_the_shared_keys_are_the_same(tmp_path: Path, text: str) -> None:
    p = tmp_path / "stockade.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as full:
        load_config(p)
    with pytest.raises(ConfigError) as lean:
        load_as(LauncherFile, p)
    assert str(lean.value) == str(full.value)
    assert str(p) in str(lean.value)
    with pytest.raises(CommandFailed) as peeked:  # configpeek's fallback to LauncherFile
        config_or_fail(str(p), "sandbox kill", peek=True)
    assert peeked.value.message == f"stockade sandbox kill: {full.value}"


def test_other_sections_stay_unread(tmp_path: Path) -> None:
    """An error in a section the short commands never read is the commands' business
    that read it (every one of them loads Config and reports it there)."""
    p = tmp_path / "stockade.yaml"
    p.write_text("gateway:\n  sniff_timeout_s: -1\n")
    with pytest.raises(ConfigError, match="sniff_timeout_s"):
        load_config(p)
    assert load_as(LauncherFile, p).gateway == {"sniff_timeout_s": -1,
                                                "control_socket": "/run/stockade/gateway.sock"}


def test_loading_it_imports_no_other_section() -> None:
    code = ("import sys, json\nfrom stockade.configfile import LauncherFile, load_as\n"
            "load_as(LauncherFile, None).event_writer(stdout=False)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    mods = set(json.loads(out.splitlines()[-1]))
    assert not {"stockade.config", "stockade.gateway.settings", "stockade.broker.settings",
                "stockade.gateway.dns.settings", "stockade.stack.settings"} & mods
