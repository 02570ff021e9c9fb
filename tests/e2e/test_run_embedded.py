"""`stockade run` on an embedded stack: concurrent runs on one run_dir share one stack (none
fails with `Address already in use` or `not ready`, a run that joined keeps the stack
after the run that started it has ended, the last one out stops it); two instances with
their own run_dir and base_port run side by side; the dev OpenBao takes a secret from a
file for a broker grant; one upstream CA serves the broker and the gateway's inspection."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e_instance import (
    forked_stack_procs,
    instance_config,
    run_argv,
    stockade_procs,
    write_config,
)
from e2e_leftovers import new_since, snapshot
from polling import eventually

from stockade.config import load_config
from stockade.stack.services import ensure_stack, stack_running

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_four_concurrent_runs_share_one_stack(tmp_path: Path, fake_internet) -> None:
    data = instance_config(tmp_path, fake_internet)
    cfg_path = write_config(tmp_path, data)
    cfg = load_config(cfg_path)
    lnch = cfg.launcher
    before = snapshot((lnch.name_prefix, lnch.nft_table), lnch.cgroup_parent, str(tmp_path))
    procs = []
    for delay in (0, 3, 6, 9):
        # the later runs use the stack after the earlier ones (the one that started it
        # among them) have ended
        script = (f"sleep {delay}; curl -sS --max-time 20 --cacert /input/ca.pem "
                  "https://allowed.test/ -o /dev/null -w 'code=%{http_code}'")
        argv = run_argv(cfg_path, "sh", "-c", script,
                        extra=("--input", f"{fake_internet.ca_pem}:/input/ca.pem"))
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = [p.communicate(timeout=400) for p in procs]
    for (out, err), p in zip(results, procs, strict=True):
        assert p.returncode == 0, err[-3000:]
        res = json.loads(out)
        assert res["ended_by"] == "exit" and res["stdout"] == "code=200", res
    # one stack served them all: one keeper start in its log
    keeper_log = (Path(cfg.log_dir) / "stack.log").read_text()
    assert keeper_log.count("embedded stack ready") == 1, keeper_log
    # the last one out stopped it, and waited for it
    assert not stack_running(cfg)
    run_dir = Path(cfg.run_dir)
    assert not (run_dir / "stack.json").exists()
    assert not list((run_dir / "leases").glob("*.lease"))
    assert not list(run_dir.glob("*.sock"))
    assert not (run_dir / "dev-vault-token").exists()
    eventually(lambda: not stockade_procs(str(tmp_path)), 10, 0.2)
    assert stockade_procs(str(tmp_path)) == {}
    after = snapshot((lnch.name_prefix, lnch.nft_table), lnch.cgroup_parent, str(tmp_path))
    assert new_since(before, after) == {}


def _ca_input(inet) -> tuple[str, ...]:
    return ("--input", f"{inet.ca_pem}:/input/ca.pem")


@pytest.mark.timeout(400)
def test_two_instances_run_side_by_side(tmp_path: Path, fake_internet) -> None:
    """Each with only its run_dir and base_port (and the launcher's host-wide names)."""
    cfgs = []
    for name in ("a", "b"):
        root = tmp_path / name
        root.mkdir()
        cfgs.append(write_config(root, instance_config(root, fake_internet)))
    assert load_config(cfgs[0]).base_port != load_config(cfgs[1]).base_port
    script = ("sleep 6; curl -sS --max-time 20 --cacert /input/ca.pem https://allowed.test/ "
              "-o /dev/null -w 'code=%{http_code}'")
    procs = [subprocess.Popen(run_argv(c, "sh", "-c", script, extra=_ca_input(fake_internet)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cfgs]
    # both stacks are up at the same time, each on its own ports and sockets
    deadline = time.monotonic() + 120
    while not all(stack_running(load_config(c)) for c in cfgs) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.1)
    assert all(stack_running(load_config(c)) for c in cfgs)
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out)["stdout"] == "code=200"
    assert not any(stack_running(load_config(c)) for c in cfgs)


BROKER_AND_INSPECTED = (
    'curl -sS --max-time 20 "$STOCKADE_BROKER/demo-api/v1/whoami"; echo; '
    # no --cacert: the sandbox trusts the inspector, which verifies echo.test upstream
    "curl -sS --max-time 20 https://echo.test/echo -o /dev/null -w 'inspected=%{http_code}'"
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("given_by", ["--secret", "dev_vault.secrets"])
def test_a_secret_from_a_file_serves_a_broker_grant(
    tmp_path: Path, fake_internet, given_by: str
) -> None:
    """--secret PATH:FIELD=@FILE (or the dev_vault.secrets setting) puts the API key into
    the dev OpenBao (it is never on argv nor in the config); the broker verifies the fake
    API with upstream_ca_file, and so does the gateway's inspector (neither has its own CA
    setting here)."""
    key = tmp_path / "api-key"
    key.write_text(fake_internet.api_key + "\n")
    key.chmod(0o600)
    entry = {"path": "stockade/demo-api", "field": "token", "file": str(key)}
    extra: dict = {"dev_vault": {"secrets": [entry]}} if given_by != "--secret" else {}
    data = instance_config(tmp_path, fake_internet, **extra)
    assert "ca_file" not in data.get("broker", {}) and "inspection" not in data["gateway"]
    cfg_path = write_config(tmp_path, data)
    assert fake_internet.api_key not in cfg_path.read_text()
    flags = ("--secret", f"stockade/demo-api:token=@{key}") if given_by == "--secret" else ()
    argv = run_argv(cfg_path, "sh", "-c", BROKER_AND_INSPECTED, extra=flags)
    assert fake_internet.api_key not in " ".join(argv)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    first, second = [line for line in res["stdout"].splitlines() if line]
    assert json.loads(first).get("user") == "demo", res
    assert second == "inspected=200", res
    assert fake_internet.api_key not in proc.stdout + proc.stderr


def test_a_secret_value_on_argv_is_refused(tmp_path: Path, fake_internet) -> None:
    cfg_path = write_config(tmp_path, instance_config(tmp_path, fake_internet))
    proc = subprocess.run(
        run_argv(cfg_path, "true", extra=("--secret", "stockade/demo-api:token=hunter2")),
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "=@FILE" in proc.stderr, proc.stderr
    assert "hunter2" not in proc.stderr
    assert not (tmp_path / "run" / "stack.json").exists()  # refused before anything started


@pytest.mark.timeout(300)
def test_a_gateway_that_dies_under_a_shared_stack_is_restarted(
    tmp_path: Path, fake_internet
) -> None:
    """The keeper of a shared stack restarts a dead component like `stockade up` does:
    a run that outlives its gateway still reaches its allowed site afterwards."""
    cfg_path = write_config(tmp_path, instance_config(
        tmp_path, fake_internet, stack={"restart_delay_s": 0.5}))
    cfg = load_config(cfg_path)
    script = ("sleep 12; curl -sS --max-time 20 --cacert /input/ca.pem https://allowed.test/ "
              "-o /dev/null -w 'code=%{http_code}'")
    proc = subprocess.Popen(run_argv(cfg_path, "sh", "-c", script, extra=_ca_input(fake_internet)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = f"gateway serve --config {cfg.run_dir}/stack-config.yaml"
    deadline = time.monotonic() + 120

    def started() -> bool:  # the start event: written once the fence self-test passed
        text = cfg.events_file.read_text() if cfg.events_file.exists() else ""
        return any('"sandbox_lifecycle"' in line and '"lifecycle":"start"' in
                   line.replace(" ", "") for line in text.splitlines())

    # until the command runs: a gateway killed during the self-test fails the start (closed)
    while time.monotonic() < deadline and not started():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    # exec'd, it names its stack-config; forked from the keeper, it is stk-gateway
    gateways = [*stockade_procs(marker), *forked_stack_procs(str(tmp_path), ("stk-gateway",))]
    assert len(gateways) == 1
    os.kill(gateways[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out)["stdout"] == "code=200"
    restarted = [json.loads(line) for line in cfg.events_file.read_text().splitlines()
                 if '"component_restarted"' in line]
    assert [e["stockade"]["service"] for e in restarted] == ["gateway"]


@pytest.mark.timeout(300)
def test_work_while_a_stack_starts_runs_once_and_its_failure_stops_the_keeper(
        tmp_path: Path, fake_internet) -> None:
    """`ensure_stack(while_starting=...)` (the run imports its launcher meanwhile): called
    once by the run that starts the keeper, never by one that joins; when it raises, the
    error is the caller's and the keeper and its stack are gone."""
    cfg_path = write_config(tmp_path, instance_config(
        tmp_path, fake_internet, dev_vault={"enabled": False}))
    cfg = load_config(cfg_path)
    calls: list[str] = []
    with ensure_stack(cfg, while_starting=lambda: calls.append("starter")) as effective:
        assert stack_running(effective)
        with ensure_stack(cfg, while_starting=lambda: calls.append("joiner")):
            pass
    assert calls == ["starter"]
    assert not stack_running(cfg)

    def fails() -> None:
        raise RuntimeError("the launcher's import failed")

    with pytest.raises(RuntimeError, match="import failed"), ensure_stack(
            cfg, while_starting=fails):
        raise AssertionError("joined a stack whose start failed")
    assert not (Path(cfg.run_dir) / "stack.json").exists()
    eventually(lambda: not stockade_procs(str(tmp_path)), 10, 0.2)
    assert stockade_procs(str(tmp_path)) == {}
    assert not stack_running(cfg)
