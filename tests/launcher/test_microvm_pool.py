"""Warm pools of microVMs against the real gateway, DNS firewall and broker (the stack of
test_launcher_stack.py) and real QEMU (TCG): a pooled guest restored from its shape's
snapshot template waits for its plan, registered as pooled (denied as `unclaimed`) and
sending nothing; a claim runs the task's command in it with the task's rules; it is used
once, the pool refills, and a launcher that dies leaves guests the next one reconciles.
A claim delivers the task's inputs read-only through the agent port; a refused input
fails the claim, the guest is torn down and the pool refills."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from polling import eventually
from stockade.launcher import Launcher, LauncherError, SandboxSpec, vmsnapshot
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
        "echo denied; id -u; ip -o -4 addr show eth0 | cut -d' ' -f7; cat; "
        "cat /sbx/cg/task/memory.max /sbx/cg/task/pids.max; ulimit -Hn"],
        stdin=b"from-stdin\n"), stack.ruleset)
    assert res.task_id == task_id, "the task ran in the pooled guest"
    lines = res.stdout.split()
    assert lines[:3] == ["allowed", "denied", "65534"], (res.stdout, res.stderr)
    assert lines[3].split("/")[0] == row["address"]  # its own address, set at the claim
    assert lines[4:5] == ["from-stdin"]  # the plan's stdin
    # the profile's limits and the settings' rlimits, put in force before the claim
    assert lines[5:] == [str(256 * 2**20), "128", str(vm_pool.s.rlimit_nofile)]
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


def test_a_claim_whose_plan_differs_from_the_pooled_guests_is_refused(
        stack: Stack, vm_pool: Launcher, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A pooled guest has its pool's user, rlimits and limits in force before its claim: a
    plan that asks for others (a launcher bug; settings changed under a running pool) is
    refused by the guest, the command never runs with the pool's instead."""
    from stockade.launcher.backends import microvm as backend

    (row,) = _pooled_records(vm_pool)
    netns = vm_pool.state.read()[row["task_id"]].netns
    real = backend._plan
    monkeypatch.setattr(backend, "_plan", lambda spec, ctx, restored: dict(
        real(spec, ctx, restored), memory=2**20))
    # (the profile's fence self-test waits for the guest's agent: the guest's reason)
    with pytest.raises(LauncherError, match="stockade-vm-init: the plan's user, rlimits or "
                       "limits are not this pooled guest's"):
        vm_pool.run(SandboxSpec("agent-vm", ["sh", "-c", "echo ran"]), stack.ruleset)
    _claimed_and_gone(vm_pool, row["task_id"], netns)


# the filter's words from inside: its mode and count, ptrace (strace), a new namespace
FILTER_PROBE = ("grep -E '^Seccomp(_filters)?:' /proc/self/status; "
                "strace -f -o /dev/null true && echo traced; "
                "unshare -U true || echo unshare-refused")


def test_a_claimed_command_runs_under_its_profiles_filter_alone(
        stack: Stack, vm_pool: Launcher) -> None:  # noqa: F811
    """The pooled command's child loads the filter of a profile that relaxes nothing before
    the claim. A claim of such a profile runs under it, once; a profile that relaxes
    ptrace gets a fresh child with its own filter (under both, the stricter would hold):
    ptrace works there and nothing else is relaxed."""
    import dataclasses

    from stockade.policy.model import SyscallRelaxation

    (row,) = _pooled_records(vm_pool)
    res = vm_pool.run(SandboxSpec("agent-vm", ["sh", "-c", FILTER_PROBE]), stack.ruleset)
    assert res.task_id == row["task_id"], "claimed from the pool"
    assert res.stdout.split("\n")[:2] == ["Seccomp:\t2", "Seccomp_filters:\t1"], res.stdout
    assert "traced" not in res.stdout and "unshare-refused" in res.stdout, res.stdout
    assert "PTRACE_TRACEME: Operation not permitted" in res.stderr, res.stderr
    assert "unshare failed: Operation not permitted" in res.stderr, res.stderr
    assert vm_pool.pools is not None and vm_pool.pools.wait_full(FILL_TIMEOUT_S)
    (row,) = _pooled_records(vm_pool)
    profile = dataclasses.replace(stack.ruleset.profiles["agent-vm"], syscalls=SyscallRelaxation(
        frozenset({"ptrace"}), "debugger tests"))
    debug = dataclasses.replace(stack.ruleset, profiles={
        **stack.ruleset.profiles, "agent-vm": profile})
    res = vm_pool.run(SandboxSpec("agent-vm", ["sh", "-c", FILTER_PROBE]), debug)
    assert res.task_id == row["task_id"], "claimed from the pool"
    assert res.stdout.split("\n")[:2] == ["Seccomp:\t2", "Seccomp_filters:\t1"], res.stdout
    assert "traced" in res.stdout and "unshare-refused" in res.stdout, (res.stdout, res.stderr)
    assert res.stderr.count("Operation not permitted") == 1, res.stderr
    assert "unshare failed: Operation not permitted" in res.stderr, res.stderr  # alone


def test_a_pooled_guests_warm_up_leaves_nothing_to_its_task(stack: Stack) -> None:  # noqa: F811
    """The pool's warm-up commands run before the claim in a read-only view of their own
    (guest_pool.warm_up): one that writes everywhere it could leaves nothing the claimed
    task finds."""
    cfg = _vm_pool_config(stack.config, 1)
    data = cfg.model_dump()
    data["launcher"]["microvm"]["pool_warmup"] = [[
        "/usr/bin/sh", "-c", "for d in /scratch /scratch/tmp /tmp /dev/shm /sbx; do "
        "echo warm > $d/warm-up; done; mkdir /scratch/warm-dir"]]
    launcher = Launcher(Config.model_validate(data), nflog=False, pools=True)
    launcher.start()
    try:
        assert launcher.pools is not None and launcher.pools.wait_full(FILL_TIMEOUT_S)
        (row,) = _pooled_records(launcher)
        res = launcher.run(SandboxSpec("agent-vm", [
            "sh", "-c", "ls -A /scratch /tmp; ls -A /dev/shm 2>/dev/null; "
            "ls /sbx/warm-up 2>&1; true"]), stack.ruleset)
    finally:
        launcher.close()
    assert res.task_id == row["task_id"] and res.exit_code == 0, res.stderr
    assert {"out", "tmp", "home"} <= set(res.stdout.split()), res.stdout  # /scratch listed
    assert "warm" not in res.stdout.replace("/sbx/warm-up", ""), res.stdout


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


# a task's writes to its inputs: each one's outcome (EROFS or EACCES expected)
_WRITE = ("import errno, sys\nfor p in sys.argv[1:]:\n    try:\n"
          "        open(p, 'a').write('x'); print('wrote', p)\n"
          "    except OSError as e:\n        print(errno.errorcode[e.errno])")


def _claimed_and_gone(launcher: Launcher, task_id: str, netns: str) -> None:
    """The claimed guest left nothing: no record, registration, netns or QEMU; the pool
    refilled with another guest."""
    assert task_id not in launcher.state.read()
    assert not Path(NETNS_DIR, netns).exists() and not _qemu_of(task_id)
    assert launcher.pools is not None and launcher.pools.wait_full(FILL_TIMEOUT_S)
    assert {r["task_id"] for r in _pooled_records(launcher)} - {task_id}


def test_a_pooled_microvm_claim_takes_inputs_read_only(
        stack: Stack, vm_pool: Launcher, tmp_path: Path) -> None:  # noqa: F811
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f.txt").write_text("deep\n")
    (tree / "sub" / "f.txt").chmod(0o666)  # writable on the host: still not in the guest
    (tree / "link").symlink_to("sub/f.txt")
    (row,) = _pooled_records(vm_pool)
    res = vm_pool.run(SandboxSpec("agent-vm", [
        "sh", "-c", "head -1 /inputs/ca.pem; cat /data/tree/link; "
        "stat -c %u /inputs/ca.pem /data/tree/sub/f.txt; "
        "python3 -c \"$0\" /inputs/ca.pem /data/tree/sub/f.txt /data/tree/new; "
        "rm -f /data/tree/link 2>/dev/null || echo rm-refused", _WRITE],
        inputs=[(stack.ca, "/inputs/ca.pem"), (str(tree), "/data/tree")]), stack.ruleset)
    assert res.task_id == row["task_id"], "the task with inputs ran in the pooled guest"
    lines = res.stdout.splitlines()
    assert lines[:4] == ["-----BEGIN CERTIFICATE-----", "deep", "0", "0"], (
        res.stdout, res.stderr)
    assert all(w in ("EROFS", "EACCES") for w in lines[4:7]), lines
    assert lines[7:] == ["rm-refused"], lines
    assert (tree / "sub" / "f.txt").read_text() == "deep\n"
    assert vm_pool.pools is not None and vm_pool.pools.wait_full(FILL_TIMEOUT_S)
    assert vm_pool.pools.rows()[0]["claims"] == 1


def test_a_refused_input_fails_the_claim_and_the_pool_refills(
        stack: Stack, vm_pool: Launcher, tmp_path: Path) -> None:  # noqa: F811
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "ok.txt").write_text("ok\n")
    big = tmp_path / "big"
    big.write_bytes(b"x" * (9 * 2**20))  # over the pooled claim's 8 MiB
    (row,) = _pooled_records(vm_pool)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tree / "sock"))
        # refused on the host before a pooled guest is taken: it stays in the pool
        for inputs, why in [([(str(tree), "/data/tree")], "is a device or a socket"),
                            ([(str(big), "/inputs/big")], "over 8388608 bytes")]:
            with pytest.raises(LauncherError, match=why):
                vm_pool.run(SandboxSpec("agent-vm", ["true"], inputs=inputs), stack.ruleset)
            assert [r["task_id"] for r in _pooled_records(vm_pool)] == [row["task_id"]]
    assert vm_pool.pools is not None and vm_pool.pools.rows()[0]["claims"] == 0
    # refused by the claimed guest (the same target twice; a guest path in its words is
    # scrubbed as any absolute path): the guest is torn down, the pool refills
    netns = vm_pool.state.read()[row["task_id"]].netns
    with pytest.raises(LauncherError, match=r"did not take the inputs: stockade-vm-init: "
                       r"input target '<host-path>' already exists"):
        vm_pool.run(SandboxSpec("agent-vm", ["true"], inputs=[
            (stack.ca, "/inputs/ca.pem"), (stack.ca, "/inputs/ca.pem")]), stack.ruleset)
    _claimed_and_gone(vm_pool, row["task_id"], netns)
    assert row["task_id"] not in _registered(stack)
    assert vm_pool.pools.rows()[0]["claims"] == 1
