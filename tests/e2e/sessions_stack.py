"""A whole stack for the orchestrator-side tests (SDK, MCP server, the agent-loop
example): `stockade up` on a self-contained instance (e2e_instance: unique names, its own
ports) against the fake internet, so a session's denials come from the real gateway and
DNS firewall. Torn down with SIGINT, as a terminal's Ctrl-C would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e_instance import instance_config, up_ready, write_config

from stockade.config import Config, load_config


@dataclass
class Stack:
    cfg_path: Path
    config: Config
    err: Path

    @property
    def socket(self) -> str:
        return self.config.launcher.control_socket




@contextlib.contextmanager
def stack_up(root: Path, inet: Any, **extra: Any) -> Iterator[Stack]:
    """`extra`: stockade.yaml sections merged into the instance's (e.g. launcher: {...})."""
    cfg_path = write_config(root, instance_config(root, inet, **extra))
    err = root / "up.err"
    with open(err, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "stockade", "up", "--config",
                                 str(cfg_path)], stdout=subprocess.DEVNULL, stderr=fh,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        up_ready(proc, err, timeout=180)
        yield Stack(cfg_path, load_config(cfg_path), err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
