"""Broker test harness: real OpenBao (DevOpenBao), real HTTPS upstreams on 127.0.0.1.

The upstream echoes what it received (method, raw path, query, headers, body) in several
encodings, so a test can both check what the broker injected and that the echo of the
key never reaches the caller.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import logging
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web
from stockade.broker.metrics import BrokerMetrics
from stockade.broker.scrub import forms
from stockade.broker.server import Broker
from stockade.broker.settings import BrokerSettings, VaultSettings
from stockade.broker.vault import VaultClient
from stockade.policy import load_rules

from stockade.events import EventWriter, read_events, validate
from stockade.tasks import Task, TaskRegistry
from stockade.testing.devvault import DevOpenBao


@pytest.fixture(scope="module")
def bao() -> Iterator[DevOpenBao]:
    with DevOpenBao() as b:
        yield b


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, str]:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return ctx, str(path)


def _echo_doc(request: web.Request, body: bytes) -> dict[str, Any]:
    return {
        "method": request.method,
        "path": request.raw_path,
        "headers": [[k, v] for k, v in request.headers.items()],
        "body": body.decode("utf-8", "replace"),
    }


@dataclass
class Upstream:
    url: str
    seen: list[dict[str, Any]] = field(default_factory=list)
    # /slow answers only once the test sets `gate`; `parked` counts calls waiting there
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    parked: int = 0


@pytest.fixture
async def upstream(tls: tuple[ssl.SSLContext, str]) -> AsyncIterator[Upstream]:
    up = Upstream("")

    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        doc = _echo_doc(request, body)
        up.seen.append(doc)
        raw = json.dumps(doc).encode()
        kind = request.match_info.get("kind", "json")
        if kind == "slow":  # a slow upstream: holds the call until the test opens the gate
            up.parked += 1
            try:
                await up.gate.wait()
            finally:
                up.parked -= 1
        auth = request.headers.get("Authorization", "") + request.headers.get("X-Api-Key", "")
        if kind == "gzip":
            return web.Response(body=gzip.compress(raw),
                                headers={"Content-Encoding": "gzip",
                                         "Content-Type": "application/json"})
        if kind == "br":
            return web.Response(body=b"\x8b\x00\x80garbage", headers={"Content-Encoding": "br"})
        if kind == "tegzip":
            # gzip as a transfer coding (aiohttp's server never sends one: raw bytes)
            payload = gzip.compress(raw)
            assert request.transport is not None
            request.transport.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n"
                b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
            request.transport.close()
            return web.Response()
        if kind == "b64":
            return web.Response(body=base64.b64encode(raw))
        if kind == "hex":
            return web.Response(body=raw.hex().encode())
        if kind == "reason":  # the key echoed in the status line's reason phrase
            if not request.query.get("stream"):
                return web.Response(status=401, reason=f"bad credential {auth}", text="no")
            resp = web.StreamResponse(status=401, reason=f"bad credential {auth}")
            await resp.prepare(request)  # no Content-Length: the broker streams it
            await resp.write(b"no")
            await resp.write_eof()
            return resp
        if kind == "header":
            return web.Response(text="ok", headers={"X-Echo": auth, "Location": f"/x?{auth}"})
        if kind == "split":
            # the credential written one byte per chunk, flushed separately
            resp = web.StreamResponse()
            await resp.prepare(request)
            for i in range(0, len(raw), 3):
                await resp.write(raw[i:i + 3])
            await resp.write_eof()
            return resp
        if kind == "redirect":
            return web.Response(status=302, headers={
                "Location": f"{up.url}/json/next?page=2",
                "Link": f'<{up.url}/json/items?page=3>; rel="next"'})
        if kind == "big":
            n = int(request.query.get("n", "1000"))
            if request.query.get("chunked"):  # no Content-Length: the broker streams it
                resp = web.StreamResponse()
                await resp.prepare(request)
                for _ in range(0, n, 100):
                    await resp.write(b"z" * 100)
                await resp.write_eof()
                return resp
            return web.Response(body=b"z" * n)
        return web.Response(body=raw, content_type="application/json")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_route("*", "/{kind}", echo)
    app.router.add_route("*", "/{kind}/{tail:.*}", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls[0])
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    up.url = f"https://localhost:{port}"
    yield up
    await runner.cleanup()


API_STYLES = {
    "echo": "inject: {style: bearer}",
    "echoh": 'inject: {style: header, header: X-Api-Key, template: "Token {secret}"}',
    "echob": "inject: {style: basic, username: bot}",
    "echoq": "inject: {style: query, param: key}",
}


def write_rules(root: Path, upstream_url: str, secret_path: str, extra_profile: str = "") -> None:
    (root / "apis").mkdir(parents=True, exist_ok=True)
    (root / "profiles").mkdir(parents=True, exist_ok=True)
    for name, inj in API_STYLES.items():
        (root / "apis" / f"{name}.yaml").write_text(
            f"api: {name}\ndescription: test echo upstream\nbase_url: {upstream_url}\n"
            f"credential: {{mount: secret, path: {secret_path}, field: token}}\n{inj}\n"
        )
    grants = "\n".join(
        f"    {name}:\n      operations:\n        - {{method: '*', path: '/**'}}\n"
        f"      rate: 1000/s\n      burst: 1000\n      max_body: 1KiB"
        for name in API_STYLES
    )
    (root / "profiles" / "agent.yaml").write_text(
        "profile: agent\ndescription: test agent\nbroker:\n  apis:\n" + grants + "\n"
    )
    (root / "profiles" / "tight.yaml").write_text(
        "profile: tight\ndescription: limited\nbroker:\n  apis:\n"
        "    echo:\n      operations:\n        - {method: GET, path: '/json/repos/*/issues'}\n"
        "      rate: 1/min\n      burst: 2\n"
        "    echoh:\n      operations:\n        - {method: GET, path: '/**'}\n"
        "      budget: {calls: 3, bytes: 1MiB}\n"
        "    echob:\n      operations:\n        - {method: GET, path: '/big'}\n"
        "      budget: {bytes: 2KiB}\n" + extra_profile
    )


@dataclass
class Harness:
    broker: Broker
    vault: VaultClient
    url: str
    secret: str
    secret_path: str
    events_path: Path
    events: EventWriter
    registry: TaskRegistry
    upstream: Upstream
    rules_dir: Path
    produced: list[bytes] = field(default_factory=list)  # every response byte the test saw

    async def call(
        self, method: str, path: str, *, local: str = "127.0.0.1", **kw: Any
    ) -> tuple[int, dict[str, str], bytes]:
        conn = aiohttp.TCPConnector(local_addr=(local, 0))
        async with aiohttp.ClientSession(connector=conn) as s, s.request(
            method, self.url + path, **kw
        ) as r:
            body = await r.read()
            headers = dict(r.headers)
        self.produced.append(json.dumps(headers).encode() + body)
        return r.status, headers, body

    async def v1(self, doc: dict[str, Any], local: str = "127.0.0.1") -> tuple[int, Any]:
        status, _h, body = await self.call("POST", "/v1/call", json=doc, local=local)
        return status, json.loads(body)

    async def raw(self, data: bytes) -> bytes:
        host, port = self.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(data)
        await writer.drain()
        out = await reader.read(65536)
        writer.close()
        self.produced.append(out)
        return out

    def event_list(self) -> list[dict[str, Any]]:
        evs = read_events(self.events_path)  # [] when nothing was written
        for ev in evs:
            validate(ev)
        return evs


def assert_no_secret(secret: str, blobs: list[bytes]) -> None:
    bad = [f for f in forms(secret) if len(f) >= 8 or f == secret.encode()]
    for blob in blobs:
        for f in bad:
            assert f not in blob, "secret (or an encoding of it) leaked"


async def start_harness(
    tmp_path: Path,
    bao: DevOpenBao,
    upstream: Upstream,
    tls_ca: str,
    *,
    vault_settings: VaultSettings | None = None,
    token: str | None = None,
    clock: Any = None,
    ttl: float = 60.0,
    stale: float = 300.0,
    settings: dict[str, Any] | None = None,
) -> tuple[Harness, web.AppRunner]:
    secret = "sk-live-" + uuid.uuid4().hex
    secret_path = "stockade/test-" + uuid.uuid4().hex[:8]
    bao.put_secret(secret_path, "token", secret)
    rules_dir = tmp_path / "rules"
    write_rules(rules_dir, upstream.url, secret_path)
    rules = load_rules(rules_dir)
    # one task makes 200 concurrent calls in test_200_concurrent_calls_one_vault_read
    bs: dict[str, Any] = {"upstream_timeout_s": 10, "max_concurrent_calls_per_task": 256,
                          **(settings or {})}
    broker_settings = BrokerSettings(listen="127.0.0.1:0", ca_file=tls_ca,
                                     secret_cache_ttl_s=ttl, serve_stale_s=stale, **bs)
    metrics = BrokerMetrics()
    vs = vault_settings or VaultSettings(address=bao.address)
    kw: dict[str, Any] = {"clock": clock} if clock else {}
    holder: list[Broker] = []
    vault = VaultClient(vs, cache_ttl_s=ttl, serve_stale_s=stale,
                        token=token if vault_settings else (token or bao.root_token),
                        on_read=metrics.vault_read, on_cache=metrics.cache_result,
                        on_status=lambda st, cause: holder[0].vault_status(st, cause), **kw)
    events_path = tmp_path / "events.jsonl"
    events = EventWriter(events_path)
    registry = TaskRegistry(None)
    registry.register(Task("t1", "127.0.0.1", "agent"))
    registry.register(Task("t2", "127.0.0.3", "tight"))
    broker = Broker(broker_settings, rules, vault, registry, events, metrics,
                    load_rules=lambda: load_rules(rules_dir))
    holder.append(broker)
    runner = broker.runner(access_log=None)  # the guarded listener the service runs
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    h = Harness(broker, vault, f"http://127.0.0.1:{port}", secret, secret_path, events_path,
                events, registry, upstream, rules_dir)
    return h, runner


async def stop_harness(h: Harness, runner: web.AppRunner) -> None:
    """Stops what start_harness started: the listener, the Vault client, the events."""
    await runner.cleanup()
    await h.vault.close()
    h.events.close()


def assert_nothing_leaked(h: Harness, log: str) -> None:
    """Every byte the test produced (responses, events, `log`, metrics) is free of the
    secret."""
    ev_bytes = h.events_path.read_bytes() if h.events_path.exists() else b""
    assert_no_secret(h.secret, [*h.produced, ev_bytes, log.encode(), h.broker.metrics.render()])


@pytest.fixture
async def harness(
    tmp_path: Path,
    bao: DevOpenBao,
    upstream: Upstream,
    tls: tuple[ssl.SSLContext, str],
    caplog: pytest.LogCaptureFixture,
) -> AsyncIterator[Harness]:
    caplog.set_level(logging.DEBUG)
    h, runner = await start_harness(tmp_path, bao, upstream, tls[1])
    try:
        yield h
    finally:
        await stop_harness(h, runner)
        assert_nothing_leaked(h, caplog.text)
