"""The broker against the fake internet's api.test (real netns, real DNS, real TLS with the
test CA): upstream names resolve through the gateway's checked resolver, the key lives only
in OpenBao, api.test accepts it in all four injection styles, api.test's echo of it is
scrubbed, and an API whose name resolves to a forbidden address (loopback.test -> 127.0.0.1,
so even a failed check would stay on this host) is never dialled."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from stockade.broker.server import Broker
from stockade.broker.settings import BrokerSettings, VaultSettings
from stockade.broker.upstream_dns import CheckedResolver
from stockade.broker.vault import VaultClient
from stockade.policy import load_rules

from stockade.events import EventWriter, read_events, validate
from stockade.net.addresses import AddressPolicy
from stockade.net.resolver import Resolver
from stockade.tasks import Task, TaskRegistry
from stockade.testing.devvault import DevOpenBao

from .conftest import assert_no_secret

pytestmark = [pytest.mark.netns, pytest.mark.vault]

STYLES = {
    "demo": "{style: bearer}",
    "demoh": "{style: header, header: X-Api-Key}",
    "demoq": "{style: query, param: key}",
    "demob": "{style: basic, username: demo}",
    "trap": "{style: bearer}",
}
WHOAMI = {"demo": "/v1/whoami", "demoh": "/v1/whoami-header", "demoq": "/v1/whoami-query",
          "demob": "/v1/whoami-basic"}


async def test_api_test_through_broker(
    fake_internet: Any, bao: DevOpenBao, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fi = fake_internet
    path = "stockade/demo-" + uuid.uuid4().hex[:8]
    bao.put_secret(path, "key", fi.api_key)
    rules = tmp_path / "rules"
    (rules / "apis").mkdir(parents=True)
    (rules / "profiles").mkdir()
    for name, inj in STYLES.items():
        (rules / "apis" / f"{name}.yaml").write_text(
            f"api: {name}\nbase_url: https://{'loopback' if name == 'trap' else 'api'}.test\n"
            f"credential: {{mount: secret, path: {path}, field: key}}\ninject: {inj}\n")
    grants = "".join(f"    {n}:\n      operations: [{{method: GET, path: '/v1/**'}}]\n"
                     for n in STYLES)
    (rules / "profiles" / "demo.yaml").write_text(
        f"profile: demo\ndescription: d\nbroker:\n  apis:\n{grants}")
    settings = BrokerSettings(listen="127.0.0.1:0", ca_file=fi.ca_pem)
    policy = AddressPolicy(allow=[fi.subnet])
    resolver = CheckedResolver(Resolver([fi.dns_server], policy), policy)
    vault = VaultClient(VaultSettings(address=bao.address), token=bao.root_token)
    registry = TaskRegistry(None)
    registry.register(Task("demo-1", "127.0.0.1", "demo"))
    events_path = tmp_path / "events.jsonl"
    events = EventWriter(events_path)
    broker = Broker(settings, load_rules(rules), vault, registry, events,
                    resolver=resolver, address_policy=policy)
    runner = web.AppRunner(broker.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    produced: list[bytes] = []
    try:
        async with aiohttp.ClientSession() as s:
            for name, route in WHOAMI.items():
                async with s.get(f"http://127.0.0.1:{port}/{name}{route}") as r:
                    body = await r.read()
                    produced.append(body)
                    assert r.status == 200, (name, body)
                    assert json.loads(body) == {"user": "demo"}
            async with s.get(f"http://127.0.0.1:{port}/trap/v1/whoami") as r:
                body = await r.read()
                produced.append(body)
                assert r.status == 502
                assert json.loads(body)["reason"] == "upstream_unreachable"
                assert b"127.0.0.1" not in body
            async with s.get(f"http://127.0.0.1:{port}/demo/v1/echo/x") as r:
                body = await r.read()
                produced.append(body + json.dumps(dict(r.headers)).encode())
                assert r.status == 200 and b"[REDACTED]" in body
    finally:
        await runner.cleanup()
        await vault.close()
        events.close()
    evs = read_events(events_path)
    for ev in evs:
        validate(ev)
    calls = [e for e in evs if e["event"]["action"] == "broker_call"]
    assert [e["event"]["outcome"] for e in calls] == ["success"] * 4 + ["failure", "success"]
    assert calls[4]["error"]["type"] == "ClientConnectorDNSError"  # refused before dialling
    assert calls[0]["destination"]["domain"] == "api.test"
    assert any(e["event"]["action"] == "secret_echo" for e in evs)
    assert_no_secret(fi.api_key, [*produced, events_path.read_bytes(), caplog.text.encode()])
