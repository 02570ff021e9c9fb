"""The rig of the session tests: `stockade launcher serve`'s service in this process (on
a loop thread of its own, real Launcher, real nft table, namespaces and cgroups, names of
its own) sharing the `lab`'s gateway and broker stand-ins, and a small HTTP client over
its Unix socket that reads streamed answers line by line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from stockade.launcher import netns, nft
from stockade.launcher.cgroups import leftover_names, remove_parent
from stockade.launcher.service import LauncherService

from stockade.config import Config
from stockade.tasks.client import _UnixHTTPConnection

from .conftest import Lab

PROFILE = """\
profile: {name}
description: session test
# the lab's stand-in gateway answers everything: its rig samples no self-tests (the
# self-test itself runs against the real stack, test_launcher_selftest.py)
selftest: sampled
limits: {{cpus: 1, memory: 128MiB, disk: 16MiB, pids: 64, ttl: {ttl}s}}
egress:
  mode: enforce
exports: {{max_file: 1KiB, max_total: 4KiB, types: [text]}}
"""


def host_leftovers(s: Any) -> dict[str, Any]:
    """What a launcher with settings `s` left on the host: its network namespaces and
    links, per-sandbox nft set elements, cgroups, scratch entries and mounts (all empty:
    nothing)."""
    elements = {k: v for k, v in nft.list_elements(s.nft_table).items()
                if v and k in nft.PER_SANDBOX_SETS}
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
              if line.split()[1].startswith(s.scratch_dir)]
    return {
        "netns": netns.list_netns(s.name_prefix),
        "links": netns.list_links(s.name_prefix),
        "elements": elements,
        "cgroups": sorted(leftover_names(s.cgroup_root, s.cgroup_parent)),
        "scratch": sorted(os.listdir(s.scratch_dir)) if os.path.isdir(s.scratch_dir) else [],
        "mounts": mounts,
    }


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(ln) for ln in self.body.splitlines() if ln.strip()]


class Api:
    """HTTP/1.1 over the service's Unix socket (one connection per call)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def call(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 120) -> Answer:
        conn = _UnixHTTPConnection(self.socket_path, timeout)
        try:
            data = raw if raw is not None else (json.dumps(body).encode()
                                                if body is not None else None)
            h = {"Content-Type": "application/json", **(headers or {})} if data else \
                dict(headers or {})
            conn.request(method, path, body=data, headers=h)
            resp = conn.getresponse()
            return Answer(resp.status, dict(resp.getheaders()), resp.read())
        finally:
            conn.close()

    def stream(self, path: str, body: Any, timeout: float = 120) -> Iterator[dict[str, Any]]:
        """The NDJSON lines of a streamed answer as they arrive."""
        conn = _UnixHTTPConnection(self.socket_path, timeout)
        try:
            conn.request("POST", path, body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            while line := resp.readline():
                yield json.loads(line)
        finally:
            conn.close()

    def create(self, profile: str, **kw: Any) -> dict[str, Any]:
        a = self.call("POST", "/v1/sessions", {"profile": profile, **kw})
        assert a.status == 201, a.body
        return dict(a.json())

    def exec(self, sid: str, argv: list[str], **kw: Any) -> dict[str, Any]:
        a = self.call("POST", f"/v1/sessions/{sid}/exec",
                      {"argv": argv, "stream": False, **kw})
        assert a.status == 200, a.body
        return dict(a.json())

    def kill(self, sid: str) -> None:
        self.call("DELETE", f"/v1/sessions/{sid}")


@dataclass
class Rig:
    svc: LauncherService
    api: Api
    config: Config
    loop: asyncio.AbstractEventLoop


def own_config(lab: Lab, tmp: Path, tag: str, net: int, nflog: int,
               profiles: dict[str, str], **launcher: Any) -> Config:
    """The lab's config with a launcher of its own (nft table, names, cgroup parent,
    address pool 10.<net>.x.0/24, NFLOG group nflog+, control socket) and `profiles`
    (name: YAML) as its rules; `launcher`: more settings."""
    rules = tmp / "rules"
    (rules / "profiles").mkdir(parents=True)
    for name, text in profiles.items():
        (rules / "profiles" / f"{name}.yaml").write_text(text)
    sfx = secrets.token_hex(3)
    settings = lab.config.launcher.model_copy(update={
        "nft_table": f"stockade_{tag}{sfx}", "name_prefix": f"{tag[0]}{sfx[:3]}",
        "cgroup_parent": f"stockade_{tag}{sfx}", "scratch_dir": str(tmp / "sbx"),
        "address_pool": f"10.{net}.{100 + secrets.randbelow(100)}.0/24",
        "nflog_group": nflog + secrets.randbelow(99),
        "control_socket": str(tmp / "run" / "launcher.sock"), **launcher,
    })
    return lab.config.model_copy(update={"launcher": settings, "rules_dir": str(rules)})


def _config(lab: Lab, tmp: Path, **launcher: Any) -> Config:
    return own_config(lab, tmp, "ss", 217, 7600, {
        "svc": PROFILE.format(name="svc", ttl=60),
        "svc-short": PROFILE.format(name="svc-short", ttl=3),
        "gv": PROFILE.format(name="gv", ttl=60) + "isolation: gvisor\n",
        "vm": PROFILE.format(name="vm", ttl=60) + "isolation: microvm\n",
    }, max_output_bytes=64 * 1024, **launcher)


@contextlib.contextmanager
def serving(lab: Lab, tmp: Path, config: Config | None = None) -> Iterator[Rig]:
    config = config or _config(lab, tmp)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    svc = LauncherService(config)
    try:
        asyncio.run_coroutine_threadsafe(svc.start(), loop).result(120)
        yield Rig(svc, Api(config.launcher.control_socket), config, loop)
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(svc.stop(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        remove_parent(config.launcher.cgroup_root, config.launcher.cgroup_parent)


@pytest.fixture(scope="module")
def rig(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with serving(lab, tmp_path_factory.mktemp("sessions")) as r:
        yield r


@pytest.fixture(params=["svc", "gv", "vm"])
def stier(request: pytest.FixtureRequest, rig: Rig) -> str:
    """The profile of a session test on the container tier (`svc`), gVisor (`gv`) and
    the microVM tier (`vm`: a guest agent over virtio-serial)."""
    s = rig.svc.launcher.s
    if request.param == "gv":
        from stockade.launcher.backends.gvisor import BACKEND

        why = BACKEND.problem(s)
        if why is not None:
            pytest.skip(f"gVisor unavailable: {why}")
    if request.param == "vm":
        from stockade.launcher import vmimage

        why = vmimage.host_problem(s.microvm.image_dir, s.microvm.qemu, s.init_python)
        if why is not None:
            pytest.skip(f"microVM unavailable: {why}")
    return str(request.param)


@pytest.fixture
def session(rig: Rig, stier: str) -> Iterator[str]:
    s = rig.api.create(stier, labels={"agent": "tester"})
    try:
        yield s["session_id"]
    finally:
        rig.api.kill(s["session_id"])


