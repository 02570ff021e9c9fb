"""Warm pools against the real gateway, DNS firewall and broker (the stack of
test_launcher_stack.py): a pooled sandbox is denied everything as `unclaimed` until a task
claims it; a claimed one has exactly its task's rules; each is used once and gone after;
a launcher that dies leaves pooled sandboxes the next one reconciles; concurrent claims
each get their own sandbox."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from polling import eventually
from stockade.launcher import Launcher, SandboxSpec
from stockade.launcher.netns import NETNS_DIR

from stockade.config import Config
from stockade.events import read_events, validate
from stockade.tasks import ControlClient

from .test_launcher_stack import Stack, stack  # noqa: F401 - the module's fixture

pytestmark = [pytest.mark.netns, pytest.mark.slow]

POOL_SIZE = 4
# the shape of the stack's `agent` profile: its tasks claim from this pool
AGENT_SHAPE = {"isolation": "container", "cpus": 1, "memory_mib": 256, "disk_mib": 64,
               "pids": 128}


def _pooled_config(config: Config, size: int = POOL_SIZE) -> Config:
    data = config.model_dump()
    data["launcher"]["pools"] = {"targets": [{**AGENT_SHAPE, "size": size}],
                                 "refill_concurrency": 2}
    return Config.model_validate(data)


@pytest.fixture
def pooled(stack: Stack) -> Iterator[Launcher]:  # noqa: F811 - the imported fixture
    # the stack's own launcher reads NFLOG: this one shares its table and state file
    launcher = Launcher(_pooled_config(stack.config), nflog=False, pools=True)
    launcher.start()
    try:
        assert launcher.pools is not None and launcher.pools.wait_full(120)
        yield launcher
    finally:
        launcher.close()


def _pooled_records(launcher: Launcher) -> list[dict[str, Any]]:
    return [r for r in launcher.list() if r["state"] == "pooled"]


def _events(st: Stack, task_id: str) -> list[dict[str, Any]]:
    evs = [e for e in read_events(st.config.events_file)
           if e.get("labels", {}).get("task_id") == task_id]
    for e in evs:
        validate(e)
    return evs


# what a pooled sandbox tries before its claim: a DNS query, TCP to an allowed site and a
# broker call (run from the host inside its netns: the source is the pooled address)
PROBE = ("import json, os, socket, sys, urllib.request, urllib.error\n"
         "gw = sys.argv[1]; broker = sys.argv[2]\n"
         "out = {}\n"
         "q = b'\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00'"
         " + b'\\x07allowed\\x04test\\x00\\x00\\x01\\x00\\x01'\n"
         "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)\n"
         "s.sendto(q, (gw, 53))\n"
         "try:\n    out['dns_rcode'] = s.recv(512)[3] & 15\n"
         "except OSError as e:\n    out['dns_rcode'] = type(e).__name__\n"
         "try:\n"
         "    c = socket.create_connection(('192.0.2.10', 80), timeout=5)\n"
         "    c.sendall(b'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n')\n"
         "    out['tcp'] = c.recv(200).decode('latin-1').split('\\r\\n')[0]\n"
         "except OSError as e:\n    out['tcp'] = type(e).__name__\n"
         "req = urllib.request.Request(broker + '/v1/call', data=json.dumps("
         "{'api': 'github', 'path': '/user'}).encode(),"
         " headers={'Content-Type': 'application/json'})\n"
         "try:\n    urllib.request.urlopen(req, timeout=10); out['broker'] = 'answered'\n"
         "except urllib.error.HTTPError as e:\n"
         "    out['broker'] = [e.code, json.loads(e.read())['reason']]\n"
         "print(json.dumps(out))\n")


def test_pooled_sandbox_is_denied_everything_as_unclaimed(stack: Stack,  # noqa: F811
                                                          pooled: Launcher) -> None:
    rec = _pooled_records(pooled)[0]
    task_id, ns = rec["task_id"], f"{NETNS_DIR}/{pooled.state.read()[rec['task_id']].netns}"
    full = pooled.state.read()[task_id]
    registered = {t.task_id: t for t in ControlClient(stack.config.gateway.control_socket).list()}
    assert registered[task_id].pooled and registered[task_id].profile == ""
    broker = f"http://{full.host_ip}:{stack.config.broker.listen.rsplit(':', 1)[1]}"
    p = subprocess.run(["nsenter", f"--net={ns}", "--", sys.executable, "-I", "-c", PROBE,
                        full.host_ip, broker], capture_output=True, text=True, timeout=60)
    out = json.loads(p.stdout)
    assert out["dns_rcode"] != 0, out  # refused, never resolved
    assert not str(out["tcp"]).startswith("HTTP/1.1 200"), out
    assert out["broker"] == [403, "unclaimed"], out

    def unclaimed() -> set[str]:
        return {e["stockade"]["component"] for e in _events(stack, task_id)
                if e["event"].get("reason") == "unclaimed"}

    seen = eventually(lambda: unclaimed() >= {"dns", "gateway", "broker"} and unclaimed(),
                      timeout=20)
    assert seen >= {"dns", "gateway", "broker"}, unclaimed()


def test_claimed_sandbox_has_its_tasks_rules_and_is_used_once(stack: Stack,  # noqa: F811
                                                              pooled: Launcher) -> None:
    before = {r["task_id"] for r in _pooled_records(pooled)}
    res = pooled.run(SandboxSpec("agent", [
        "sh", "-c", "curl -sS --max-time 10 --cacert /inputs/ca.pem https://allowed.test/ "
        ">/dev/null && echo allowed; curl -sS --max-time 5 --cacert /inputs/ca.pem "
        "https://denied.test/ >/dev/null || echo denied; cat /inputs/ca.pem | head -1; "
        "touch /inputs/x 2>/dev/null || echo inputs-ro"],
        inputs=[(stack.ca, "/inputs/ca.pem")], labels={"run.id": "pool-1"}), stack.ruleset)
    assert res.task_id in before, "the task ran in a pooled sandbox"
    # as a cold start: the fence self-test before the command, the task's labels in its
    # registration (the gateway's and DNS firewall's events) and in the launcher's own
    (start,) = [e for e in _events(stack, res.task_id) if e["event"]["action"] ==
                "sandbox_lifecycle" and e["stockade"].get("lifecycle") == "start"]
    assert start["stockade"]["pool"] and start["labels"]["run.id"] == "pool-1", start
    assert start["stockade"]["selftest"]["passed"] is True, start["stockade"]["selftest"]
    lines = res.stdout.splitlines()
    assert lines == ["allowed", "denied", "-----BEGIN CERTIFICATE-----", "inputs-ro"], (
        res.stdout, res.stderr)
    denied = [e for e in res.denials if e["stockade"]["component"] in ("dns", "gateway")]
    assert denied and all(e["event"]["reason"] != "unclaimed" for e in denied), denied
    assert all(e["labels"]["run.id"] == "pool-1" for e in denied), denied
    assert res.task_id not in pooled.state.read()
    assert not Path(NETNS_DIR, f"{pooled.s.name_prefix}-{res.task_id}").exists()
    assert res.task_id not in {t.task_id for t in ControlClient(
        stack.config.gateway.control_socket).list()}
    assert pooled.pools is not None and pooled.pools.wait_full(120)
    assert res.task_id not in {r["task_id"] for r in _pooled_records(pooled)}


def test_concurrent_claims_each_get_their_own_sandbox(stack: Stack) -> None:  # noqa: F811
    n = 6
    launcher = Launcher(_pooled_config(stack.config, n), nflog=False, pools=True)
    launcher.start()
    try:
        assert launcher.pools is not None and launcher.pools.wait_full(180)
        pooled_ids = {r["task_id"] for r in _pooled_records(launcher)}
        results: list[Any] = []
        go = threading.Barrier(n)

        def one() -> None:
            go.wait()
            results.append(launcher.run(SandboxSpec("agent", [
                "sh", "-c", "cat /proc/self/cgroup | wc -l; ls /scratch; touch /scratch/mine"]),
                stack.ruleset))

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == n
        assert all(r.exit_code == 0 for r in results), [r.stderr for r in results]
        ids = [r.task_id for r in results]
        assert len(set(ids)) == n and set(ids) <= pooled_ids, (ids, pooled_ids)
        # nothing of another task: every scratch was empty when its command started
        assert all("mine" not in r.stdout for r in results), [r.stdout for r in results]
        for tid in ids:
            start = [e for e in _events(stack, tid) if e["event"]["action"] ==
                     "sandbox_lifecycle" and "pool" in json.dumps(e)]
            assert start, tid
        rows = launcher.pools.rows()
        assert rows[0]["claims"] == n and rows[0]["misses"] == 0, rows
    finally:
        launcher.close()


CRASHER = """
import json, os, signal, sys
from stockade.config import Config
from stockade.launcher import Launcher
cfg = Config.model_validate(json.loads(sys.argv[1]))
launcher = Launcher(cfg, nflog=False, pools=True)
launcher.start()
assert launcher.pools.wait_full(120)
print(json.dumps([r["task_id"] for r in launcher.list() if r["state"] == "pooled"]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_refill_after_a_launcher_crash_reconciles_leftovers(stack: Stack) -> None:  # noqa: F811
    cfg = _pooled_config(stack.config, 2)
    p = subprocess.run([sys.executable, "-c", CRASHER, cfg.model_dump_json()],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == -9, p.stderr
    left = set(json.loads(p.stdout))
    assert len(left) == 2 and left <= set(stack.launcher.state.read())
    launcher = Launcher(cfg, nflog=False, pools=True)
    launcher.start()  # reconcile, then refill
    try:
        assert launcher.pools is not None and launcher.pools.wait_full(120)
        records = launcher.state.read()
        assert not left & set(records), "the dead launcher's pooled sandboxes are removed"
        prefix = launcher.s.name_prefix
        assert not [t for t in left if Path(NETNS_DIR, f"{prefix}-{t}").exists()]
        assert not left & {t.task_id for t in ControlClient(
            stack.config.gateway.control_socket).list()}
        assert len([r for r in records.values() if r.state == "pooled"]) >= 2
    finally:
        launcher.close()


@contextlib.contextmanager
def _gvisor_pool(stack: Stack) -> Iterator[Launcher]:  # noqa: F811
    """A launcher of its own with a full pool of two gVisor sandboxes of AGENT_SHAPE."""
    from stockade.launcher.backends.gvisor import BACKEND

    why = BACKEND.problem(stack.launcher.s)
    if why is not None:
        pytest.skip(f"gVisor unavailable: {why}")
    data = stack.config.model_dump()
    data["launcher"]["pools"] = {"targets": [{**AGENT_SHAPE, "isolation": "gvisor",
                                              "size": 2}]}
    launcher = Launcher(Config.model_validate(data), nflog=False, pools=True)
    launcher.start()
    try:
        assert launcher.pools is not None and launcher.pools.wait_full(180)
        yield launcher
    finally:
        launcher.close()


def test_gvisor_pool_claim_and_unclaimed(stack: Stack) -> None:  # noqa: F811
    with _gvisor_pool(stack) as launcher:
        pooled_ids = {r["task_id"] for r in _pooled_records(launcher)}
        assert {r["isolation"] for r in _pooled_records(launcher)} == {"gvisor"}
        # unclaimed: the broker refuses the pooled address (DNS and TCP as in the
        # container tier's test: the address, not the tier, is what is denied)
        rec = launcher.state.read()[sorted(pooled_ids)[0]]
        broker = f"http://{rec.host_ip}:{stack.config.broker.listen.rsplit(':', 1)[1]}"
        p = subprocess.run(["nsenter", f"--net={NETNS_DIR}/{rec.netns}", "--",
                            sys.executable, "-I", "-c", PROBE, rec.host_ip, broker],
                           capture_output=True, text=True, timeout=60)
        assert json.loads(p.stdout)["broker"] == [403, "unclaimed"], p.stdout + p.stderr
        res = launcher.run(SandboxSpec("agent-gv", [
            "sh", "-c", "curl -sS -k --max-time 10 https://allowed.test/ >/dev/null && "
            "echo allowed; curl -sS -k --max-time 5 https://denied.test/ >/dev/null || "
            "echo denied; id -u; echo $STOCKADE_BROKER | cut -c1-7; "
            "ls /inputs 2>/dev/null || echo no-inputs"]), stack.ruleset)
        assert res.task_id in pooled_ids, "the task ran in a pooled gVisor sandbox"
        assert res.stdout.split() == ["allowed", "denied", "65534", "http://", "no-inputs"], (
            res.stdout, res.stderr)
        assert res.task_id not in launcher.state.read()
        assert launcher.pools.rows()[0]["claims"] == 1


def test_gvisor_pool_claim_takes_inputs_read_only(stack: Stack,  # noqa: F811
                                                  tmp_path: Path) -> None:
    """A pooled gVisor sandbox's mounts are fixed when runsc starts it: the claim copies
    the inputs into its read-only root. The task reads them (a file, a tree with a
    symlink) and can write none of them; the next pooled task sees none of them."""
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f.txt").write_text("deep\n")
    (tree / "sub" / "f.txt").chmod(0o666)  # writable on the host: still not in the sandbox
    (tree / "link").symlink_to("sub/f.txt")
    with _gvisor_pool(stack) as launcher:
        pooled_ids = {r["task_id"] for r in _pooled_records(launcher)}
        write = ("import errno, sys\nfor p in sys.argv[1:]:\n    try:\n"
                 "        open(p, 'a').write('x'); print('wrote', p)\n"
                 "    except OSError as e:\n        print(errno.errorcode[e.errno])")
        res = launcher.run(SandboxSpec("agent-gv", [
            "sh", "-c", "head -1 /inputs/ca.pem; cat /data/tree/link; "
            "python3 -c \"$0\" /inputs/ca.pem /data/tree/sub/f.txt /data/tree/new; "
            "rm -f /data/tree/link 2>/dev/null || echo rm-refused", write],
            inputs=[(stack.ca, "/inputs/ca.pem"), (str(tree), "/data/tree")]), stack.ruleset)
        assert res.task_id in pooled_ids, "the task with inputs ran in a pooled sandbox"
        lines = res.stdout.splitlines()
        assert lines[:2] == ["-----BEGIN CERTIFICATE-----", "deep"], (res.stdout, res.stderr)
        assert all(w in ("EROFS", "EACCES") for w in lines[2:5]), lines
        assert lines[5:] == ["rm-refused"], lines
        assert (tree / "sub" / "f.txt").read_text() == "deep\n"
        after = launcher.run(SandboxSpec("agent-gv", [
            "sh", "-c", "ls /inputs /data 2>/dev/null || echo none"]), stack.ruleset)
        assert after.task_id in pooled_ids and after.stdout.split() == ["none"], (
            after.stdout, after.stderr)
        assert launcher.pools.rows()[0]["claims"] == 2


def test_killing_a_pooled_sandbox_removes_it_and_the_pool_refills(
        stack: Stack, pooled: Launcher) -> None:  # noqa: F811
    victim = _pooled_records(pooled)[0]["task_id"]
    assert pooled.kill(victim)
    assert victim not in pooled.state.read()
    assert not Path(NETNS_DIR, f"{pooled.s.name_prefix}-{victim}").exists()
    assert victim not in {t.task_id for t in ControlClient(
        stack.config.gateway.control_socket).list()}
    assert pooled.pools is not None and pooled.pools.wait_full(120)
    assert victim not in {r["task_id"] for r in _pooled_records(pooled)}
    res = pooled.run(SandboxSpec("agent", ["true"]), stack.ruleset)
    assert res.exit_code == 0 and res.task_id != victim
