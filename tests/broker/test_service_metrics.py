"""The wired `BrokerService` against a real OpenBao, read through its real /metrics
listener: `stockade_broker_vault_up` follows a failed start-up login and the recovery,
and rule reloads count by result with the gateway's event reasons."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from stockade.broker.service import BrokerService

from stockade.config import load_config
from stockade.events import read_events, validate
from stockade.tasks import Task
from stockade.testing.devvault import DevOpenBao

from .conftest import Upstream, assert_no_secret, write_rules

pytestmark = pytest.mark.vault


async def scrape(svc: BrokerService) -> dict[str, float]:
    assert svc.metrics_address is not None
    host, port = svc.metrics_address
    async with aiohttp.ClientSession() as s, s.get(f"http://{host}:{port}/metrics") as r:
        text = await r.text()
    return {line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def service(tmp: Path, rules: Path, vault_address: str, token_file: Path,
            **broker: Any) -> BrokerService:
    """A BrokerService on loopback ports of its own, its files under `tmp`."""
    cfg = tmp / "stockade.yaml"
    cfg.write_text(json.dumps({
        "rules_dir": str(rules), "state_dir": str(tmp / "state"),
        "log_dir": str(tmp / "log"), "run_dir": str(tmp / "run"),
        "events": {"file": str(tmp / "events.jsonl")},
        "broker": {"listen": "127.0.0.1:0", "control_socket": str(tmp / "run" / "b.sock"),
                   "metrics_listen": "127.0.0.1:0", **broker},
        "vault": {"address": vault_address, "token_file": str(token_file)},
    }))
    return BrokerService(load_config(cfg))


async def test_vault_up_follows_startup_login_and_reloads_are_counted(
    bao: DevOpenBao, upstream: Upstream, tls: tuple[ssl.SSLContext, str], tmp_path: Path
) -> None:
    secret = "sk-svc-" + uuid.uuid4().hex
    secret_path = "stockade/svc-" + uuid.uuid4().hex[:8]
    bao.put_secret(secret_path, "token", secret)
    rules = tmp_path / "rules"
    write_rules(rules, upstream.url, secret_path)
    token_file = tmp_path / "token"
    token_file.write_text("s.not-a-valid-token\n")  # Vault answers, the login is refused
    events = tmp_path / "events.jsonl"
    svc = service(tmp_path, rules, bao.address, token_file, ca_file=tls[1],
                  hosts={"localhost": "127.0.0.1"})
    produced: list[bytes] = []
    await svc.start()
    try:
        assert svc.registry is not None and svc.listen_address is not None
        svc.registry.register(Task("s1", "127.0.0.1", "agent"))
        base = "http://{}:{}".format(*svc.listen_address)
        m = await scrape(svc)
        assert m["stockade_broker_vault_up"] == 0.0  # start-up login failed

        async def call() -> tuple[int, dict[str, Any]]:
            async with aiohttp.ClientSession() as s, s.get(f"{base}/echo/json") as r:
                body = await r.read()
                produced.append(body)
                return r.status, json.loads(body)

        status, doc = await call()
        assert (status, doc["reason"]) == (503, "vault_unavailable")
        assert (await scrape(svc))["stockade_broker_vault_up"] == 0.0
        # the token file is re-read at every login: a valid token brings Vault back
        token_file.write_text(bao.root_token)
        status, doc = await call()
        assert status == 200 and secret not in json.dumps(doc)
        assert (await scrape(svc))["stockade_broker_vault_up"] == 1.0

        # reloads: one refused, one accepted, counted like the gateway's
        prof = rules / "profiles" / "agent.yaml"
        good = prof.read_text()
        prof.write_text("profile: [broken\n")
        assert (await svc.reload())["ok"] is False
        prof.write_text(good)
        assert (await svc.reload("sighup"))["ok"] is True
        m = await scrape(svc)
        assert m['stockade_broker_rule_reloads_total{result="failure"}'] == 1.0
        assert m['stockade_broker_rule_reloads_total{result="success"}'] == 1.0
        produced.append(json.dumps(m).encode())
    finally:
        await svc.stop()
    evs = read_events(events)
    for ev in evs:
        validate(ev)
    status_evs = [e["event"]["reason"] for e in evs if e["event"]["action"] == "vault_status"]
    assert status_evs == ["vault_unavailable", "vault_up"]
    reloads = [e for e in evs if e["event"]["action"] == "rules_reload"]
    assert [(e["event"]["reason"], e["event"]["outcome"], e["stockade"]["trigger"])
            for e in reloads] == [("rules_invalid", "failure", "control"),
                                  ("rules_loaded", "success", "sighup")]
    assert_no_secret(secret, [*produced, events.read_bytes()])
    assert bao.root_token.encode() not in b"".join(produced) + events.read_bytes()


@pytest.mark.parametrize("cc", ["cubic", None])
async def test_sandbox_connections_use_the_configured_congestion_control(
    bao: DevOpenBao, tmp_path: Path, cc: str | None
) -> None:
    """`broker.sandbox_congestion_control` is set on the listener: a connection a sandbox
    opens has it (seen by the kernel, `ss`); None keeps the system default."""
    rules = tmp_path / "rules"
    write_rules(rules, "https://localhost:1", "stockade/unused")
    svc = service(tmp_path, rules, bao.address, tmp_path / "no-token",
                  sandbox_congestion_control=cc)
    await svc.start()
    try:
        assert svc.listen_address is not None
        port = svc.listen_address[1]
        conn = socket.create_connection(svc.listen_address, timeout=5)
        try:
            out = ""
            for _ in range(50):  # the broker's side of it is there once accepted
                out = subprocess.run(
                    ["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                    capture_output=True, text=True, check=True).stdout
                if out.strip():
                    break
                await asyncio.sleep(0.05)
            algo = out.split("\n", 1)[1].split()[0]
        finally:
            conn.close()
    finally:
        await svc.stop()
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    assert algo == (cc or default)


async def test_without_a_vault_a_granted_call_is_refused(
    upstream: Upstream, tmp_path: Path
) -> None:
    """`dev_vault.enabled: false` and no vault.address (an embedded stack whose rules had
    no grant): the broker starts without logging in anywhere, and a call that a grant
    (added since) would need is refused `vault_unavailable`."""
    rules = tmp_path / "rules"
    write_rules(rules, upstream.url, "stockade/none")
    cfg = tmp_path / "stockade.yaml"
    cfg.write_text(json.dumps({
        "rules_dir": str(rules), "state_dir": str(tmp_path / "state"),
        "log_dir": str(tmp_path / "log"), "run_dir": str(tmp_path / "run"),
        "events": {"file": str(tmp_path / "events.jsonl")},
        "broker": {"listen": "127.0.0.1:0", "control_socket": str(tmp_path / "run" / "b.sock")},
        "dev_vault": {"enabled": False},
    }))
    svc = BrokerService(load_config(cfg))
    await svc.start()
    try:
        assert svc.registry is not None and svc.listen_address is not None
        assert svc.broker is not None and svc.broker.status()["vault"] == "none"
        svc.registry.register(Task("s1", "127.0.0.1", "agent"))
        base = "http://{}:{}".format(*svc.listen_address)
        async with aiohttp.ClientSession() as s, s.get(f"{base}/echo/json") as r:
            status, doc = r.status, json.loads(await r.read())
        assert (status, doc["reason"]) == (503, "vault_unavailable")
    finally:
        await svc.stop()
    evs = read_events(tmp_path / "events.jsonl")
    for ev in evs:
        validate(ev)
    # no login was tried: no vault_status transition to report
    assert not [e for e in evs if e["event"]["action"] == "vault_status"]
