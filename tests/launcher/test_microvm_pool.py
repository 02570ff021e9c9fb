"""Warm pools of microVMs against the real gateway, DNS firewall and broker (the stack of
test_launcher_stack.py) and real QEMU (TCG): a pooled guest restored from its shape's
snapshot template waits for its plan, registered as pooled (denied as `unclaimed`) and
sending nothing; a claim runs the task's command in it with the task's rules; it is used
once, the pool refills, and a launcher that dies leaves guests the next one reconciles."""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from polling import eventually
from stockade.launcher import Launcher, SandboxSpec, vmsnapshot
from stockade.launcher.netns import NETNS_DIR

from stockade.config import Config
from stockade.tasks import ControlClient

from .test_launcher_pools import AGENT_SHAPE, _events, _pooled_records, crash_leaving
from .test_launcher_stack import Stack, stack  # noqa: F401 - the module's fixture
from .test_microvm_session import run

pytestmark = [pytest.mark.netns, pytest.mark.slow]

# the shape of the stack's `agent-vm` profile
VM_SHAPE = {**AGENT_SHAPE, "isolation": "microvm"}
# a refill may build the shape's template first (one boot and save under TCG)
FILL_TIMEOUT_S = 600


def _vm_pool_config(config: Config, size: int) -> Config:
    data = config.model_dump()
    data["launcher"]["pools"] = {"targets": [{**VM_SHAPE, "size": size}],
                                 "refill_concurrency": 1}
    data["launcher"]["microvm"]["snapshots"] = True
    return Config.model_validate(data)


@pytest.fixture
def vm_pool(stack: Stack) -> Iterator[Launcher]:  # noqa: F811 - the imported fixture
    launcher = Launcher(_vm_pool_config(stack.config, 1), nflog=False, pools=True)
    launcher.start()
    try:
        assert launcher.pools is not None and launcher.pools.wait_full(FILL_TIMEOUT_S)
        yield launcher
    finally:
        launcher.close()


def _guest_forwarded(launcher: Launcher, task_id: str) -> int:
    """Frames of the guest that reached the network: what the tap's mirred filters (IP and
    ARP from the guest's MAC, launcher/netns.py) passed to the veth, in its netns."""
    rec = launcher.state.read()[task_id]
    out = subprocess.run(["ip", "netns", "exec", rec.netns, "tc", "-s", "filter", "show",
                          "dev", "tap0", "ingress"], capture_output=True, text=True,
                         check=True).stdout
    sent = re.findall(r"Sent \d+ bytes (\d+) pkt", out)
    assert sent, out  # the filters are there
    return sum(int(n) for n in sent)


def _registered(stack: Stack) -> dict[str, Any]:  # noqa: F811
    return {t.task_id: t for sock in (stack.config.gateway.control_socket,
                                      stack.config.broker.control_socket)
            for t in ControlClient(sock).list()}


def test_a_pooled_microvm_waits_unclaimed_then_runs_one_task(
        stack: Stack, vm_pool: Launcher) -> None:  # noqa: F811
    (row,) = _pooled_records(vm_pool)
    task_id = row["task_id"]
    assert row["isolation"] == "microvm"
    live, netns = vm_pool._live[task_id], vm_pool.state.read()[task_id].netns
    assert live.pipes.restored, "a refill restores its shape's template"
    state = Path(vm_pool.config.state_dir) / "launcher" / vmsnapshot.SNAP_DIR
    assert list(state.glob(f"*{vmsnapshot.SUFFIX}"))
    reg = _registered(stack)[task_id]
    assert reg.pooled and reg.profile == ""  # the gateway and broker deny it as unclaimed
    assert _guest_forwarded(vm_pool, task_id) == 0  # it has its address; nothing sends
    res = vm_pool.run(SandboxSpec("agent-vm", [
        "sh", "-c", "curl -sS -k --max-time 20 https://allowed.test/ >/dev/null && "
        "echo allowed; curl -sS -k --max-time 10 https://denied.test/ >/dev/null || "
        "echo denied; id -u; ip -o -4 addr show eth0 | cut -d' ' -f7; cat"],
        stdin=b"from-stdin\n"), stack.ruleset)
    assert res.task_id == task_id, "the task ran in the pooled guest"
    lines = res.stdout.split()
    assert lines[:3] == ["allowed", "denied", "65534"], (res.stdout, res.stderr)
    assert lines[3].split("/")[0] == row["address"]  # its own address, set at the claim
    assert lines[4:] == ["from-stdin"]  # the plan's stdin
    (start,) = [e for e in _events(stack, task_id) if e["stockade"].get("lifecycle") ==
                "start"]
    assert start["stockade"]["pool"] and start["stockade"]["selftest"], start
    denied = [e for e in res.denials if e["stockade"]["component"] in ("dns", "gateway")]
    assert denied and all(e["event"]["reason"] != "unclaimed" for e in denied), denied
    # used once: gone, never handed out again; the pool refills with another guest
    assert task_id not in vm_pool.state.read() and task_id not in _registered(stack)
    assert not Path(NETNS_DIR, netns).exists()
    assert vm_pool.pools is not None and vm_pool.pools.wait_full(FILL_TIMEOUT_S)
    (again,) = _pooled_records(vm_pool)
    assert again["task_id"] != task_id
    assert vm_pool.pools.rows()[0]["claims"] == 1
    # a task with inputs cannot take a pooled guest (its shares are fixed): a cold start
    cold = vm_pool.run(SandboxSpec("agent-vm", ["cat", "/inputs/ca.pem"],
                                   inputs=[(stack.ca, "/inputs/ca.pem")]), stack.ruleset)
    assert cold.exit_code == 0 and cold.task_id != again["task_id"], cold.stderr
    assert vm_pool.pools.rows()[0]["claims"] == 1


def _qemu_of(task_id: str) -> bool:
    return subprocess.run(["pgrep", "-f", rf"^\S*qemu-system-\S+ .*/{task_id}/"],
                          capture_output=True).returncode == 0


def test_pooled_microvms_of_a_dead_launcher_are_reconciled(stack: Stack) -> None:  # noqa: F811
    cfg = _vm_pool_config(stack.config, 1)
    left = crash_leaving(stack, cfg, 1, FILL_TIMEOUT_S + 60)
    launcher = Launcher(cfg, nflog=False, pools=True)
    launcher.start()  # reconcile, then refill
    try:
        assert launcher.pools is not None and launcher.pools.wait_full(FILL_TIMEOUT_S)
        assert not left & set(launcher.state.read())
        assert not [t for t in left if _qemu_of(t)], "no QEMU of the dead launcher's guests"
        assert not left & set(_registered(stack))
        assert len(_pooled_records(launcher)) == 1
    finally:
        launcher.close()


def test_a_session_claims_a_pooled_microvm(stack: Stack, vm_pool: Launcher) -> None:  # noqa: F811
    (row,) = _pooled_records(vm_pool)
    task_id, box = row["task_id"], {}

    def go() -> None:
        box["result"] = vm_pool.run(SandboxSpec("agent-vm", ["true"], session=True),
                                    stack.ruleset)

    def running() -> bool:  # the pooled record becomes the session's: the same task id
        rec = vm_pool.state.read().get(task_id)
        return rec is not None and rec.state == "running"

    t = threading.Thread(target=go, daemon=True)
    t.start()
    try:
        assert eventually(running, timeout=120), box
        live = vm_pool._live[task_id]
        for _ in range(2):  # execs through the agent its init loaded before the claim
            rc, out, err = run(live, ["sh", "-c", "id -u; cat"], stdin=b"in")
            assert rc == 0 and out.split() == ["65534", "in"], (rc, out, err)
    finally:
        vm_pool.kill(task_id)
        t.join(60)
    assert box["result"].task_id == task_id
    assert task_id not in vm_pool.state.read()
