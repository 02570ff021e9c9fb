"""Runs a real GatewayService on its own event loop thread, so tests can drive it with
blocking clients (curl, urllib, pip) and the real control socket."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

from gw_config import write_config, write_profiles
from polling import wait_until
from stockade.gateway.service import GatewayService

from stockade.config import load_config
from stockade.events import read_events, validate
from stockade.ports import free_port
from stockade.tasks import ControlClient, Task
from stockade.testing.testnet import ClientNamespace


def gateway_config(
    tmp: Path, fi: Any, rules: Path, dns: dict[str, Any] | None = None, **gateway: Any
) -> Path:
    """A gateway on the fake internet `fi` over the rules directory `rules`: both listeners
    on any address, its DNS server upstream, its subnet dialable; `gateway` settings (these
    too) on top."""
    shared = {"transparent_listen": ["0.0.0.0:0"], "proxy_listen": ["0.0.0.0:0"],
              "resolvers": [fi.dns_server], "allow_addresses": [fi.subnet]}
    return write_config(tmp, rules, dns, **{**shared, **gateway})


def fake_internet_config(
    tmp: Path, fi: Any, profiles: dict[str, str], dns: dict[str, Any] | None = None,
    **gateway: Any,
) -> Path:
    """`gateway_config` over a rules directory with just these profiles."""
    return gateway_config(tmp, fi, write_profiles(tmp / "rules", profiles), dns, **gateway)


class GatewayHarness:
    def __init__(self, config_path: Path) -> None:
        self.config = load_config(config_path)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.svc: GatewayService | None = None
        self._validated = 0

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, *, dns: bool = False) -> GatewayHarness:
        self.thread.start()

        async def make() -> GatewayService:
            svc = GatewayService(self.config)
            await svc.start(dns=dns)
            return svc

        self.svc = self.run(make())
        return self

    def stop(self) -> None:
        if self.svc is not None:
            self.run(self.svc.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @property
    def control(self) -> ControlClient:
        return ControlClient(self.config.gateway.control_socket)

    def port(self, kind: str) -> int:
        assert self.svc is not None
        return int(self.svc.gateway.bound[kind][0][1])  # type: ignore[index]

    def register(self, task_id: str, address: str, profile: str, **kw: Any) -> None:
        self.control.register(Task(task_id, address, profile, **kw))

    def events(self) -> list[dict[str, Any]]:
        """Every event so far, each validated against the schema (once)."""
        evs = read_events(self.config.events_file)
        for ev in evs[self._validated :]:
            validate(ev)
        self._validated = len(evs)
        return evs

    def decisions(self, task_id: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events()
            if e["event"]["action"] == "connection_decision"
            and (task_id is None or e.get("labels", {}).get("task_id") == task_id)
        ]


def wait_ready(gw: GatewayHarness, timeout: float = 60) -> None:
    """Until `gw`'s inspector child answers (AssertionError with its why after `timeout`)."""
    insp = gw.svc.inspector  # type: ignore[union-attr]
    assert insp is not None
    wait_until(lambda: insp.ready, timeout, what=lambda: f"inspector not ready: {insp.why}")


@contextlib.contextmanager
def running_gateway(
    cfg: Path, *, dns: bool = False, inspector: bool = False
) -> Iterator[GatewayHarness]:
    """A started GatewayHarness on `cfg` (with its DNS firewall if `dns`; its inspector
    ready first if `inspector`), stopped afterwards."""
    h = GatewayHarness(cfg).start(dns=dns)
    try:
        if inspector:
            wait_ready(h)
        yield h
    finally:
        h.stop()


def dotted(ev: dict[str, Any], path: str) -> Any:
    """An event's field by a dotted path written with `__` (labels__task_id), or None."""
    cur: Any = ev
    for part in path.split("__"):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def newest_event(
    gw: GatewayHarness, action: str, timeout: float = 10, **match: Any
) -> dict[str, Any]:
    """The newest event of `action` whose dotted fields (a__b) equal `match`, waited for up
    to `timeout` s: the gateway's and the inspector's events are written a moment after
    the fact (those of allowed flows in batches)."""

    def newest() -> dict[str, Any] | None:
        for ev in reversed(gw.events()):
            if ev["event"]["action"] == action and all(
                dotted(ev, k) == v for k, v in match.items()
            ):
                return ev
        return None

    return wait_until(newest, timeout, 0.1, what=f"no {action} event matching {match}")


def client_namespace(gw: GatewayHarness, tag: str = "gw") -> ClientNamespace:
    """A started client namespace whose TCP (but the proxy port) and DNS nftables
    redirect to `gw`: a sandbox as the launcher wires it."""
    return ClientNamespace(
        name_suffix=f"{tag}{secrets.token_hex(3)}",
        redirect_tcp_port=gw.port("transparent"),
        redirect_dns_port=free_port(),
        exempt_tcp_ports=(gw.port("proxy"),),
    ).start()


@contextlib.contextmanager
def registered_client(
    gw: GatewayHarness, task: str, profile: str, tag: str = "gw"
) -> Iterator[ClientNamespace]:
    """`client_namespace`, registered with `gw` as `task` (`profile`) while in use;
    deregistered and removed afterwards."""
    ns = client_namespace(gw, tag)
    try:
        gw.register(task, ns.address, profile)
        yield ns
    finally:
        gw.control.deregister(task)
        ns.stop()


def pip_download(
    ns: ClientNamespace, dest: Path, proxy: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`pip download` of the fake index's project into `dest`, from inside `ns` through the
    explicit proxy `proxy`, with `args` before the project and `env` on top. A clean pip: no
    host pip.conf/indexes, and no CA-bundle variables (requests lets REQUESTS_CA_BUNDLE
    override --cert)."""
    from stockade.testing.testnet.wheel import PROJECT

    run_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PIP_") and k not in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
    }
    run_env.update(
        {
            "HTTPS_PROXY": proxy,
            "PIP_NO_CACHE_DIR": "1",
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            **(env or {}),
        }
    )
    return ns.run(
        [
            sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest),
            "--index-url", "https://pypi.test/simple/", *args, PROJECT,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=run_env,
    )  # fmt: skip


def connect_tunnel(proxy: tuple[str, int], authority: str,
                   source: str | None = None) -> socket.socket:
    """A CONNECT tunnel to `authority` through the explicit proxy at `proxy` (from
    `source`), its `200` read a byte at a time: nothing after the head is consumed."""
    s = socket.create_connection(proxy, timeout=10,
                                 source_address=(source, 0) if source else None)
    s.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        got = s.recv(1)
        assert got, f"closed after {head!r}"
        head += got
    assert head.startswith(b"HTTP/1.1 200"), head
    return s

