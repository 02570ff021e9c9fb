"""`stockade up` keeps its components running: a gateway killed under it comes back after
a backoff with a `component_restarted` event; the dev OpenBao is not restarted (a secret
given with --secret survives); and while the gateway is down a sandbox's connection is
refused by the closed fence, it never goes direct."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import hvac
import pytest
from e2e_instance import instance_config, up_ready, write_config
from polling import eventually
from stockade.launcher import SandboxSpec
from stockade.launcher.service import LauncherClient

from stockade.config import load_config
from stockade.events import validate
from stockade.procs import pid_alive

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]

# probe the denied site's IP: 403 through the gateway, 000 while nothing listens behind
# the redirect, 200 only if the fence let the sandbox go direct; stops 3 probes after
# the gateway is back
PROBE = """
seen=0; ok=0; n=0
while [ $n -lt 300 ]; do
  c=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 2 http://{ip}/)
  echo "$c"
  [ "$c" = 000 ] && seen=1
  if [ $seen = 1 ] && [ "$c" != 000 ]; then ok=$((ok+1)); [ $ok -ge 3 ] && break; fi
  n=$((n+1)); sleep 0.2
done
"""


def _pid(text: str, component: str) -> int:
    pids = re.findall(rf"stockade up: {re.escape(component)}\s+pid (\d+)", text)
    assert pids, text
    return int(pids[-1])


@pytest.mark.timeout(400)
def test_a_killed_gateway_is_restarted_and_the_fence_holds(tmp_path: Path, fake_internet):
    data = instance_config(tmp_path, fake_internet, stack={"restart_delay_s": 2.0})
    cfg_path = write_config(tmp_path, data)
    cfg = load_config(cfg_path)
    key = tmp_path / "key"
    key.write_text("kept-across-restarts\n")
    err = tmp_path / "up.err"
    with open(err, "wb") as fh:
        up = subprocess.Popen(
            [sys.executable, "-m", "stockade", "up", "--config", str(cfg_path),
             "--secret", f"stockade/kept:value=@{key}"],
            stdout=subprocess.DEVNULL, stderr=fh, start_new_session=True)
    try:
        text = up_ready(up, err)
        gateway, bao = _pid(text, "gateway"), _pid(text, "openbao (dev)")
        client = LauncherClient(cfg.launcher.control_socket, timeout=30)
        task = client.start(SandboxSpec(
            "e2e", ["sh", "-c", PROBE.format(ip=fake_internet.addresses["denied.test"])]))
        time.sleep(3)  # a few probes through the live gateway first
        os.kill(gateway, signal.SIGKILL)
        back = re.compile(r"stockade up: gateway\s+pid \d+\s+restarted")
        assert eventually(lambda: back.search(err.read_text()), 90, 0.1), err.read_text()
        assert "gateway exited (-9); restarting in 2.0s" in err.read_text()
        assert eventually(lambda: client.result(task) is not None, 90, 0.1)
        res = client.result(task)
        assert res is not None and res.ended_by == "exit", res
        codes = res.stdout.split()
        assert "200" not in codes, codes  # never direct
        assert "000" in codes and codes[0] == "403" and codes[-1] == "403", codes
        assert set(codes) <= {"403", "000"}, codes
        # the new gateway is another process; the dev OpenBao is the same one, secret kept
        assert _pid(err.read_text(), "gateway") != gateway
        assert pid_alive(bao)
        eff = load_config(json.loads((Path(cfg.run_dir) / "stack.json").read_text())
                          ["config_file"])
        token = Path(eff.vault.token_file).read_text().strip()
        read = hvac.Client(url=eff.vault.address, token=token).secrets.kv.v2.read_secret_version(
            path="stockade/kept", mount_point="secret", raise_on_deleted_version=True)
        assert read["data"]["data"] == {"value": "kept-across-restarts"}
        restarted = [json.loads(line) for line in cfg.events_file.read_text().splitlines()
                     if '"component_restarted"' in line]
        assert len(restarted) == 1, restarted
        ev = restarted[0]
        validate(ev)
        assert ev["stockade"]["component"] == "stack"
        assert ev["stockade"]["service"] == "gateway" and ev["stockade"]["restarts"] == 1
        assert ev["process"]["exit_code"] == -signal.SIGKILL
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(timeout=90) == 0, err.read_text()
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    assert not (Path(cfg.run_dir) / "stack.json").exists()
    assert not pid_alive(bao)
