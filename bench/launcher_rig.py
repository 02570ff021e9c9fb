"""What the launcher benchmarks share: a configuration on names of their own (nft table,
interface prefix, cgroup parent, address pool) and a started Launcher next to stand-in
gateway and broker registries, everything removed at the end."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stockade.launcher import Launcher
from stockade.launcher.cgroups import remove_parent

from stockade.config import Config
from stockade.tasks import TaskRegistry, make_control_app, start_control_server


def bench_config(tmp: Path, name: str, pool: str, nflog_group: int, **launcher: Any) -> Config:
    sfx = secrets.token_hex(3)
    return Config.model_validate({
        "state_dir": str(tmp / "state"), "log_dir": str(tmp / "log"), "run_dir": str(tmp / "run"),
        "gateway": {"transparent_listen": ["0.0.0.0:47001"],
                    "control_socket": str(tmp / "gw.sock")},
        "dns": {"listen": ["0.0.0.0:47053"]},
        "broker": {"listen": "0.0.0.0:47081", "control_socket": str(tmp / "br.sock")},
        "launcher": {"nft_table": f"stockade_{name}{sfx}", "name_prefix": f"{name[0]}{sfx[:3]}",
                     "cgroup_parent": f"stockade_{name}{sfx}", "scratch_dir": str(tmp / "sbx"),
                     "address_pool": pool, "nflog_group": nflog_group, **launcher},
    })


@contextlib.contextmanager
def stand_ins(cfg: Config) -> Iterator[asyncio.AbstractEventLoop]:
    """The stand-in gateway and broker registries on an event loop of their own (the
    loop, for the caller's own coroutines); at the end the launcher's table and cgroup
    parent are removed too, if its owner left them."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runners = [asyncio.run_coroutine_threadsafe(start_control_server(
        make_control_app(TaskRegistry()), p), loop).result(10)
        for p in (cfg.gateway.control_socket, cfg.broker.control_socket)]
    try:
        yield loop
    finally:
        subprocess.run(["nft", "delete", "table", "inet", cfg.launcher.nft_table], check=False,
                       capture_output=True)
        remove_parent(cfg.launcher.cgroup_root, cfg.launcher.cgroup_parent)
        for r in runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


@contextlib.contextmanager
def started_launcher(name: str, pool: str, nflog_group: int,
                     **launcher: Any) -> Iterator[Launcher]:
    tmp = Path(tempfile.mkdtemp(prefix=f"stockade-{name}-"))
    cfg = bench_config(tmp, name, pool, nflog_group, **launcher)
    with stand_ins(cfg):
        launcher = Launcher(cfg)
        try:
            launcher.start()
            yield launcher
        finally:
            launcher.close()
            shutil.rmtree(tmp, ignore_errors=True)
