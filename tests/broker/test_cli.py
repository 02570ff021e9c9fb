"""The real `stockade broker serve --config FILE` process: control socket, calls, metrics,
SIGHUP reload, SIGTERM shutdown; then every byte it produced is searched for the secret."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest
from polling import async_wait_until

from stockade.events import read_events, validate
from stockade.tasks import ControlClient, Task
from stockade.testing.devvault import DevOpenBao, free_port

from .conftest import Upstream, assert_no_secret, write_rules

pytestmark = pytest.mark.vault


async def test_broker_serve_cli(
    bao: DevOpenBao, upstream: Upstream, tls: tuple[ssl.SSLContext, str], tmp_path: Path
) -> None:
    secret = "sk-cli-" + uuid.uuid4().hex
    secret_path = "stockade/cli-" + uuid.uuid4().hex[:8]
    bao.put_secret(secret_path, "token", secret)
    rules = tmp_path / "rules"
    write_rules(rules, upstream.url, secret_path)
    # a definition whose host is a loopback literal: the broker refuses to dial it
    (rules / "apis" / "loopy.yaml").write_text(
        "api: loopy\nbase_url: https://127.0.0.2:9\n"
        f"credential: {{mount: secret, path: {secret_path}, field: token}}\n"
        "inject: {style: bearer}\n")
    prof = rules / "profiles" / "agent.yaml"
    prof.write_text(prof.read_text() + "    loopy:\n      operations: [{method: GET, path: /}]\n")
    # a token that may read the test secret only
    bao.client().sys.create_or_update_policy(
        name="cli-read", policy=f'path "secret/data/{secret_path}" {{ capabilities = ["read"] }}')
    token = bao.client().auth.token.create(policies=["cli-read"], ttl="1h")["auth"]["client_token"]
    (tmp_path / "token").write_text(token)
    port, mport = free_port(), free_port()
    sock = tmp_path / "run" / "broker.sock"
    events = tmp_path / "events.jsonl"
    cfg = tmp_path / "stockade.yaml"
    cfg.write_text(json.dumps({
        "rules_dir": str(rules), "state_dir": str(tmp_path / "state"),
        "log_dir": str(tmp_path / "log"), "run_dir": str(tmp_path / "run"),
        "events": {"file": str(events)},
        "broker": {"listen": f"127.0.0.1:{port}", "control_socket": str(sock),
                   "metrics_listen": f"127.0.0.1:{mport}", "ca_file": tls[1],
                   "hosts": {"localhost": "127.0.0.1"}},
        "vault": {"address": bao.address, "token_file": str(tmp_path / "token")},
    }))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stockade", "broker", "serve", "--config", str(cfg),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    produced: list[bytes] = []
    try:
        assert proc.stderr is not None
        while True:
            line = await asyncio.wait_for(proc.stderr.readline(), 60)
            produced.append(line)
            assert line, b"".join(produced).decode()
            if b"listening on" in line:
                break
        loop = asyncio.get_running_loop()
        ctl = ControlClient(sock)
        await loop.run_in_executor(None, ctl.register, Task("cli-1", "127.0.0.1", "agent"))
        assert (await loop.run_in_executor(None, ctl.health))["tasks"] == 1
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/echo/json/x", headers={"Authorization": "Bearer mine"}) as r:
                body = await r.read()
                produced.append(body)
                assert r.status == 200
                assert b"[REDACTED]" in body
            assert ["Authorization", f"Bearer {secret}"] in upstream.seen[-1]["headers"]
            async with s.get(f"{base}/loopy/") as r:
                assert r.status == 502 and (await r.json())["reason"] == "upstream_unreachable"
                produced.append(await r.read())
            async with s.post(f"{base}/v1/call", json={"api": "echoh", "path": "/b64"}) as r:
                body = await r.read()
                produced.append(body)
                assert r.status == 200 and json.loads(body)["status"] == 200
            # invalid rules + SIGHUP: refused, the old rules keep serving
            good = (rules / "profiles" / "agent.yaml").read_text()
            (rules / "profiles" / "agent.yaml").write_text("profile: [broken\n")
            proc.send_signal(signal.SIGHUP)
            for _ in range(200):
                if any(e["event"]["action"] == "rules_reload" for e in read_events(events)):
                    break
                await asyncio.sleep(0.05)
            async with s.get(f"{base}/echo/json/y") as r:
                produced.append(await r.read())
                assert r.status == 200
            # fixed rules through the control API: accepted
            (rules / "profiles" / "agent.yaml").write_text(good.split("    echoh:")[0])
            result = await loop.run_in_executor(None, ctl.reload)
            assert result["ok"] is True
            async with s.post(f"{base}/v1/call", json={"api": "echoh", "path": "/json"}) as r:
                assert r.status == 403 and (await r.json())["reason"] == "api_not_allowed"
            async with s.get(f"http://127.0.0.1:{mport}/metrics") as r:
                metrics = await r.read()
                produced.append(metrics)
            want = b'stockade_broker_calls_total{api="echo",outcome="allowed_by_rule"} 2.0'
            assert want in metrics
            assert b"stockade_broker_scrubs_total" in metrics
        await loop.run_in_executor(None, ctl.deregister, "cli-1")
        async with aiohttp.ClientSession() as s, s.get(f"{base}/echo/json/z") as r:
            assert r.status == 403 and (await r.json())["reason"] == "unknown_task"
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 30)
        assert rc == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        out = await proc.stdout.read() if proc.stdout else b""
        err = await proc.stderr.read() if proc.stderr else b""
        produced += [out, err]
    evs = read_events(events)
    for ev in evs:
        validate(ev)
    actions = [e["event"]["action"] for e in evs]
    assert actions.count("broker_call") == 6 and "secret_echo" in actions
    loopy = [e for e in evs if e["stockade"].get("api") == "loopy"]
    assert loopy[0]["stockade"]["address_category"] == "loopback"
    reloads = [e for e in evs if e["event"]["action"] == "rules_reload"]
    assert [(e["event"]["outcome"], e["stockade"]["trigger"]) for e in reloads] == [
        ("failure", "sighup"), ("success", "control")]
    assert_no_secret(secret, [*produced, events.read_bytes()])
    assert token.encode() not in b"".join(produced) + events.read_bytes()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
async def test_broker_serve_dev_vault_leaves_no_process(tmp_path: Path, sig: int) -> None:
    rules = tmp_path / "rules"
    write_rules(rules, "https://localhost:9", "stockade/none")
    cfg = tmp_path / "stockade.yaml"
    cfg.write_text(json.dumps({
        "rules_dir": str(rules), "state_dir": str(tmp_path / "state"),
        "log_dir": str(tmp_path / "log"), "run_dir": str(tmp_path / "run"),
        "broker": {"listen": f"127.0.0.1:{free_port()}",
                   "control_socket": str(tmp_path / "run" / "b.sock"), "metrics_listen": ""},
    }))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stockade", "broker", "serve", "--config", str(cfg), "--dev-vault",
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # what a SIGKILL leaves stays in tmp_path
    )
    try:
        assert proc.stderr is not None
        while b"listening on" not in (line := await asyncio.wait_for(proc.stderr.readline(), 60)):
            assert line
        # children are listed per thread (the dev server is started from a worker thread)
        children = [c for t in Path(f"/proc/{proc.pid}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        bao_pids = [int(p) for p in children
                    if b"bao" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(bao_pids) == 1
        proc.send_signal(sig)
        assert await asyncio.wait_for(proc.wait(), 30) == (0 if sig == signal.SIGTERM else -sig)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    # SIGTERM: stopped by the broker; SIGKILL: by the parent-death signal (then reaped by
    # init, so wait for it to go)
    await async_wait_until(lambda: not Path(f"/proc/{bao_pids[0]}").exists())
    assert not Path(f"/proc/{bao_pids[0]}").exists()


async def test_broker_serve_without_vault_address_refuses(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    write_rules(rules, "https://localhost:9", "stockade/none")
    cfg = tmp_path / "stockade.yaml"
    cfg.write_text(json.dumps({"rules_dir": str(rules), "state_dir": str(tmp_path / "s"),
                               "log_dir": str(tmp_path / "l"), "run_dir": str(tmp_path / "r")}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stockade", "broker", "serve", "--config", str(cfg),
        stderr=asyncio.subprocess.PIPE,
    )
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"vault.address is not set" in err
