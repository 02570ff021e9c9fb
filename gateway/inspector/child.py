"""The inspector process: a mitmproxy master with the Stockade addon.

`stockade gateway inspector` is started (and restarted) by the gateway service
(`supervisor.py`); it is not meant to be run by hand. It reads its spec (one JSON line:
rules dir, events file, CA dir, listen address, upstream CAs and the hand-off signing
key) from stdin, prints `{"ready": PORT}` on stdout once it listens, and exits when
stdin closes (the gateway went away). Later stdin lines are the gateway's control
messages (`control.py`): a deregistered task's summaries and totals are written then.

Why mitmproxy in a child: its proxy core is slow (hundreds of requests/s) and lives on
its own event loop; in a child it can never stall the gateway's listeners, and a crash
costs only the inspected flows (which then fail closed). Only flows whose allow entries
need method/path or `host_must_match_sni` ever come here (see `handoff.py`).

The options below keep mitmproxy in regular (explicit-proxy) mode on loopback only,
with `connection_strategy=lazy` and `upstream_cert=false` (nothing is dialled before the
client's ClientHello names the flow's host; the addon's `tls_clienthello` then dials the
checked address first, unless `inspection.upstream_first` is off) and without its DNS
addons (no name is ever resolved). It runs on uvloop when the gateway does
(`gateway.uvloop`), and `patches.py` drops two of mitmproxy's per-request costs it does not
need (a debug-only type check, deep copies of immutable options).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from stockade.events.writer import SUMMARY_FLUSH_S, EventWriter
from stockade.loops import every
from stockade.serving import run
from stockade.trust import CA_BASENAME

from . import patches
from .addon import RulesByVersion, StockadeAddon
from .control import ControlLines

log = logging.getLogger("stockade.gateway.inspector")


def _options(spec: dict[str, Any]) -> dict[str, Any]:
    host, _, port = spec["listen"].rpartition(":")
    return {
        "mode": [f"regular@{host.strip('[]')}:{int(port)}"],
        "confdir": spec["ca_dir"],
        "connection_strategy": "lazy",
        "upstream_cert": False,
        "http2": True,
        "http3": False,
        "websocket": False,
        "rawtcp": True,  # so non-HTTP bytes get a TCP layer, which next_layer refuses
        "ssl_insecure": False,
        "ssl_verify_upstream_trusted_ca": spec.get("upstream_ca_file"),
        "ssl_verify_upstream_trusted_confdir": spec.get("system_ca_dir"),
        "validate_inbound_headers": True,
        "stream_large_bodies": None,
        "block_global": True,
        "block_private": False,
    }


class Ready:
    """Prints `{"ready": PORT}` once mitmproxy listens (the supervisor waits for it)."""

    def __init__(self, master: Any) -> None:
        self.master = master

    def running(self) -> None:
        ps = self.master.addons.get("proxyserver")
        addrs = ps.listen_addrs()
        port = addrs[0][1] if addrs else 0
        sys.stdout.write(json.dumps({"ready": port}) + "\n")
        sys.stdout.flush()
        # nobody reads the pipe from here on: anything else written to stdout goes to
        # stderr, so a full pipe can never block the inspector
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


async def run_inspector(spec: dict[str, Any], stdin_fd: int | None = None) -> None:
    from mitmproxy import options
    from mitmproxy.addons import block, core, disable_h2c, next_layer, proxyserver
    from mitmproxy.master import Master

    key = bytes.fromhex(spec["key"])
    from stockade.events.settings import EventSettings

    ev = EventSettings.model_validate(spec.get("events", {}))
    # stdout is the ready channel
    writer = ev.writer(spec.get("events_file"), spec.get("task_dir"), stdout=False)
    rules = RulesByVersion(spec["rules_dir"])
    rules.load()
    patches.install()
    opts = options.Options()
    master = Master(opts)
    addon = StockadeAddon(key, rules, writer.write, bool(spec.get("upstream_first", True)))
    patches.STATE.addon = addon
    master.addons.add(
        core.Core(),
        block.Block(),
        disable_h2c.DisableH2C(),
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),
        patches.tls_config_class()(),
        addon,
    )
    opts.update(**_options(spec))
    master.addons.add(Ready(master))
    if stdin_fd is not None:
        _watch_stdin(stdin_fd, writer, master)
    # ended windows' summaries go out every second, as the gateway's and broker's do,
    # not only with the next event of the task
    flusher = asyncio.ensure_future(
        every(SUMMARY_FLUSH_S, writer.flush_due, "inspector: event summaries", log))
    try:
        await master.run()
    finally:
        flusher.cancel()
        if stdin_fd is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(stdin_fd)
        writer.close()


def _watch_stdin(fd: int, writer: EventWriter, master: Any) -> None:
    """Act on the gateway's control lines (control.py) on stdin; shut down at its EOF
    (the gateway closed it or went away)."""
    loop = asyncio.get_running_loop()
    lines = ControlLines()

    def readable() -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            master.shutdown()
            return
        bad = lines.bad
        for task_id in lines.feed(data):
            writer.end_task(task_id)
        if lines.bad != bad:
            log.warning("inspector: %d unreadable control line(s) on stdin", lines.bad - bad)

    loop.add_reader(fd, readable)


def _read_spec(line: bytes) -> dict[str, Any]:
    """The spec from its stdin line; ValueError naming what is wrong."""
    spec = json.loads(line)
    for k in ("key", "rules_dir", "ca_dir", "listen"):
        if not isinstance(spec.get(k), str):
            raise ValueError(k)
    if not (Path(spec["ca_dir"]) / f"{CA_BASENAME}-ca.pem").exists():
        raise ValueError("no CA in ca_dir (the gateway creates it)")
    return spec


async def _serve(spec: dict[str, Any]) -> None:
    """run_inspector until stdin reaches EOF (the gateway closed it or went away)."""
    await run_inspector(spec, sys.stdin.fileno())


def main() -> int:
    """`stockade gateway inspector`: the spec is the first line on stdin."""
    line = sys.stdin.buffer.readline()
    try:
        spec = _read_spec(line)
    except ValueError as e:
        sys.stderr.write(f"stockade gateway inspector: bad spec on stdin: {e}\n")
        return 2
    logging.basicConfig(
        level=spec.get("log_level", "WARNING"),
        stream=sys.stderr,
        format="%(asctime)s inspector %(name)s %(levelname)s %(message)s",
    )
    with contextlib.suppress(KeyboardInterrupt):
        run(_serve(spec), uvloop=spec.get("uvloop") is not False)
    return 0
