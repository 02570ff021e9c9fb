"""What the launcher benchmarks share: a configuration on names of their own (nft table,
interface prefix, cgroup parent, address pool) and a started Launcher next to stand-in
gateway and broker registries, everything removed at the end."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stockade.launcher import Launcher, SandboxSpec
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
def started_launcher(name: str, pool: str, nflog_group: int, keep_pools: bool = False,
                     **launcher: Any) -> Iterator[Launcher]:
    """`keep_pools`: the launcher keeps `launcher.pools` (as the launcher service does)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"stockade-{name}-"))
    cfg = bench_config(tmp, name, pool, nflog_group, **launcher)
    with stand_ins(cfg):
        launcher = Launcher(cfg, pools=keep_pools)
        try:
            launcher.start()
            yield launcher
        finally:
            launcher.close()
            shutil.rmtree(tmp, ignore_errors=True)


def sleeping_sandbox(launcher: Launcher, ruleset: Any,
                     profile: str = "bench") -> tuple[threading.Thread, dict[str, Any], str]:
    """A `sleep 60` sandbox run in a thread: the thread, its result box (`r` once it
    ended) and its task id once it is running."""
    box: dict[str, Any] = {}
    th = threading.Thread(target=lambda: box.setdefault(
        "r", launcher.run(SandboxSpec(profile, ["sleep", "60"]), ruleset)))
    th.start()
    while True:
        running = [x for x in launcher.list() if x["state"] == "running"]
        if running:
            return th, box, running[0]["task_id"]
        time.sleep(0.001)


def timed_claim(launcher: Launcher, ruleset: Any, cmd: list[str], *, wait_full: float = 300,
                inputs: list[tuple[str, str]] | None = None,
                clock: Callable[[str], float] = float,
                profile: str = "bench") -> tuple[float, float]:
    """One run of `cmd` (which prints the guest's `$EPOCHREALTIME`, or a time `clock` reads
    as seconds since the epoch): (seconds from the run's start to that output, to the run's
    end). `wait_full`: seconds to wait for a full pool first (0: no wait, e.g. a cold
    start)."""
    if wait_full:
        assert launcher.pools is not None and launcher.pools.wait_full(wait_full)
    t0 = time.time()
    r = launcher.run(SandboxSpec(profile, cmd, inputs=list(inputs or [])), ruleset)
    t1 = time.time()
    assert r.exit_code == 0, r.stderr
    return clock(r.stdout) - t0, t1 - t0


def proc_clock(out: str) -> float:
    """`stat -c %y`'s `2026-12-07 11:01:44.938178600 +0000` (or `$EPOCHREALTIME`'s seconds)
    as seconds since the epoch (the guest's clock is UTC)."""
    if " " not in out.strip():
        return float(out)
    day, clock, zone = out.split()
    if zone != "+0000":
        raise ValueError(f"not UTC: {out!r}")
    whole, _, frac = clock.partition(".")
    at = datetime.datetime.fromisoformat(f"{day}T{whole}+00:00").timestamp()
    return at + float(f"0.{frac or 0}")
