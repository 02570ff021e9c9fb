"""The fence self-test and the signed task record with the real gateway, DNS firewall and
broker (the stack of test_launcher_stack.py, a module of its own here): a fence that holds
passes and its probes stay out of the run's denials; each broken fence (the redirect of
one sandbox deleted, the DNS firewall stopped, a route that bypasses the gateway, a set
element widened) refuses the start with `fence_unverified` and an event naming the probe;
the task record verifies, and a tampered one does not."""
# ruff: noqa: F811

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from polling import eventually
from stockade.launcher import LauncherError, SandboxSpec, fence, nft, probes
from stockade.launcher.selftest import FENCE_UNVERIFIED

from stockade.events import read_events, validate
from stockade.events.summary import is_probe
from stockade.events.taskstore import read_task_events

# the stack fixture, imported (F401, and F811 for every test taking it): module-scoped,
# so this module gets a stack of its own, whose gateway a test may stop
from .test_launcher_stack import Stack, stack  # noqa: F401

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def _record_of(stack: Stack, tmp: Path) -> tuple[Any, Path]:
    out = tmp / "out"
    out.mkdir()
    res = stack.launcher.run(SandboxSpec("agent", ["sh", "-c", "echo hi > /scratch/a.txt"],
                                         export_dir=str(out)), stack.ruleset)
    assert res.exit_code == 0, res.stderr
    return res, out / "stockade-record.json"


def _start(stack: Stack) -> dict[str, Any]:
    res = stack.run(["true"])
    return next(e for e in read_events(stack.config.events_file)
                if e.get("labels", {}).get("task_id") == res.task_id
                and e["stockade"].get("lifecycle") == "start")


def test_a_holding_fence_passes_and_its_probes_are_not_the_runs(stack: Stack) -> None:
    start = _start(stack)
    validate(start)
    st = start["stockade"]["selftest"]
    assert st["passed"] is True, st
    names = {p["probe"] for p in st["probes"]}
    assert {"dns_denied_name", "tls_denied_name", "outside_resolver", "raw_ip", "udp",
            "host_service", "exempt_port_elsewhere", "ipv6", "allowed_name"} <= names, names
    assert any(n.startswith("control_tcp_") for n in names), names
    assert all(p["passed"] for p in st["probes"]), st
    res = stack.run(["true"])
    assert res.denials == []  # the probes' denials are in the store, not in the run's


def test_the_probes_events_name_markers(stack: Stack) -> None:
    """So the gateway's and the DNS firewall's throttles keep them off the task's event
    budget (stockade/events/summary.py); only the raw-IP probe is nameless by design."""
    tid = _start(stack)["labels"]["task_id"]
    decided = [e for e in read_events(stack.config.events_file)
               if e.get("labels", {}).get("task_id") == tid
               and e["event"]["action"] in ("connection_decision", "dns_decision")]
    assert len(decided) >= 7, decided
    unmarked = [e for e in decided if not is_probe(e)]
    assert [e["event"]["reason"] for e in unmarked] == ["sni_missing"], unmarked


def _spent(stack: Stack, task_id: str,
           wait: tuple[str, ...] = ("gateway", "launcher")) -> dict[str, int]:
    """The bytes of the task's event budget each component process spent (its
    `event_totals`; a process the task left no event in writes none and spent nothing),
    once the totals of `wait` are in the task's store."""
    def totals() -> dict[str, Any] | None:
        evs = read_task_events(stack.config.task_events_dir, task_id)
        out = {e["stockade"]["component"]: e["stockade"]["totals"] for e in evs
               if e["event"]["action"] == "event_totals"}
        return out if set(wait) <= set(out) else None

    found = eventually(totals, timeout=15)
    assert found is not None
    return {c: found[c]["bytes"] for c in ("gateway", "dns", "launcher") if c in found}


def test_the_probes_spend_none_of_the_tasks_budgets(stack: Stack,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every probe's event, the unmarked ones too (TLS without SNI and UDP to the raw
    address), is written and in the totals, but the task's
    budgets after the self-test are those of a task whose self-test was off."""
    probed = stack.run(["sh", "-c", "sleep 0.5"])  # the NFLOG reader's event is in by then
    kinds = {(e["stockade"]["component"], e["event"]["action"], e["stockade"].get("decision"))
             for e in read_task_events(stack.config.task_events_dir, probed.task_id)
             if not is_probe(e)}
    # (the allowed name's query is logged only with dns.log_allowed)
    assert {("gateway", "connection_decision", "denied"),
            ("launcher", "bypass_attempt", "denied")} <= kinds, kinds
    monkeypatch.setattr(fence, "should_run", lambda mode, rate: False)
    plain = stack.run(["sh", "-c", "sleep 0.5"])
    with_test, without = _spent(stack, probed.task_id), _spent(stack, plain.task_id, ())
    assert set(with_test.values()) == {0}, with_test
    assert set(without.values()) <= {0}, without


# after the self-test, the command sends what the unmarked probes send
MIMIC = """
import socket, ssl, sys
raw = sys.argv[1]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
for _ in range(2):
    try:
        ctx.wrap_socket(socket.create_connection((raw, 443), timeout=5)).do_handshake()
    except OSError:
        pass
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", (raw, 443))
"""


def test_a_command_mimicking_the_probes_spends_its_budget(stack: Stack) -> None:
    raw = stack.config.launcher.selftest.raw_ip
    res = stack.run(["python3", "-c", MIMIC, raw])
    assert res.exit_code == 0, res.stderr
    spent = _spent(stack, res.task_id)
    assert spent["gateway"] > 0 and spent["launcher"] > 0, spent
    mine = [(e["stockade"]["component"], e["event"]["reason"]) for e in res.denials]
    assert mine.count(("gateway", "sni_missing")) == 2, mine


def _verify(stack: Stack, record: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    chain = Path(stack.config.events.chain_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "stockade", "task", "verify", str(record), "--json",
         "--key", str(chain / "signing.pub"), "--heads", str(chain / "heads"), *extra],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_the_task_record_verifies_and_a_tampered_one_does_not(
        stack: Stack, tmp_path: Path) -> None:
    res, path = _record_of(stack, tmp_path)
    env = json.loads(path.read_text())
    assert env["payloadType"] == "application/vnd.stockade.task-record.v1+json"
    import base64

    record = json.loads(base64.b64decode(env["payload"]))
    assert record["task_id"] == res.task_id and record["ended_by"] == "exit"
    assert record["rules"]["version"] == stack.ruleset.version
    assert record["selftest"]["passed"] is True
    assert {"launcher", "gateway", "dns"} <= set(record["chains"]), record["chains"]
    assert record["counts"]["flows"] == {"allowed": 0, "denied": 0}  # probes left out
    events = stack.config.events_file
    rules = stack.config.rules_dir
    code, out = _verify(stack, path, "--rules", rules, "--events", events)
    assert code == 0 and out["ok"], out

    # an edited field: the signature no longer holds
    edited = dict(record, ended_by="ttl")
    bad = dict(env, payload=base64.b64encode(json.dumps(edited).encode()).decode())
    (tmp_path / "edited.json").write_text(json.dumps(bad))
    code, out = _verify(stack, tmp_path / "edited.json")
    assert code == 1 and out["checks"][0]["name"] == "signature", out

    # another rule set than the record's
    other = tmp_path / "rules"
    (other / "profiles").mkdir(parents=True)
    (other / "profiles" / "agent.yaml").write_text(
        Path(rules, "profiles", "agent.yaml").read_text().replace("launcher stack test",
                                                                  "another rule set"))
    code, out = _verify(stack, path, "--rules", str(other))
    assert code == 1, out
    assert [c["name"] for c in out["checks"] if not c["ok"]] == ["rules"], out

    # an event removed: the task's last gateway line, the one the record names ...
    from stockade.events.chain import digest as line_digest

    lines = Path(events).read_bytes().splitlines(keepends=True)
    last = record["chains"]["gateway"]["digest"]
    assert _verify_without(stack, tmp_path, path, lines, last) == {"chain:gateway"}
    # ... or an earlier one of the task's: the gateway stream's chain has a gap
    first = next(line_digest(ln) for ln in lines
                 if json.loads(ln).get("labels", {}).get("task_id") == res.task_id
                 and json.loads(ln)["stockade"]["component"] == "gateway")
    assert first != last
    assert _verify_without(stack, tmp_path, path, lines, first) == {"events"}


def _verify_without(stack: Stack, tmp: Path, record: Path, lines: list[bytes],
                    digest: str) -> set[str]:
    """The checks that fail for the event file without the line of `digest`."""
    from stockade.events.chain import digest as line_digest

    kept = [ln for ln in lines if line_digest(ln) != digest]
    assert len(kept) == len(lines) - 1
    (tmp / "cut.jsonl").write_bytes(b"".join(kept))
    code, out = _verify(stack, record, "--events", str(tmp / "cut.jsonl"))
    assert code == 1, out
    return {c["name"] for c in out["checks"] if not c["ok"]}


def _sabotage(monkeypatch: pytest.MonkeyPatch, stack: Stack,
              breaks: Callable[[Any], Callable[[], None]]) -> None:
    """Break the next sandbox's fence once it is wired, right before its probes run
    (`breaks(record)` breaks it and returns the repair, run after the probes so the
    teardown finds what it removes)."""
    real = probes.run_probes  # the fence imports it when it probes

    def broken(netns: str, plan: Any, timeout: float) -> Any:
        rec = next(r for r in stack.launcher.state.read().values() if r.netns == netns)
        repair = breaks(rec)
        try:
            return real(netns, plan, timeout)
        finally:
            repair()

    monkeypatch.setattr(probes, "run_probes", broken)


def _refused(stack: Stack, *probes: str, profile: str = "agent") -> None:
    before = {r["task_id"] for r in stack.launcher.list()}
    with pytest.raises(LauncherError, match=FENCE_UNVERIFIED) as e:
        stack.run(["sh", "-c", "echo must-not-run"], profile=profile)
    for p in probes:
        assert p in str(e.value), e.value
    assert {r["task_id"] for r in stack.launcher.list()} == before  # torn down
    ev = [e for e in read_events(stack.config.events_file)
          if e.get("event", {}).get("reason") == FENCE_UNVERIFIED][-1]
    validate(ev)
    assert ev["stockade"]["lifecycle"] == "selftest" and ev["stockade"]["decision"] == "denied"
    failed = {p["probe"] for p in ev["stockade"]["selftest"]["probes"] if not p["passed"]}
    assert set(probes) <= failed, ev
    assert all(p in ev["message"] for p in probes), ev["message"]


def _nft_element(verb: str, table: str, name: str, elem: Any) -> None:
    nft.run({"nftables": [{verb: {"element": {"family": "inet", "table": table,
                                              "name": name, "elem": [elem]}}}]})


def test_a_deleted_redirect_is_detected(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    table = stack.config.launcher.nft_table

    def breaks(rec: Any) -> Callable[[], None]:
        _nft_element("delete", table, nft.SET_IFS, rec.ifname)
        return lambda: _nft_element("add", table, nft.SET_IFS, rec.ifname)

    _sabotage(monkeypatch, stack, breaks)
    _refused(stack, "tls_denied_name", "raw_ip")


def _gateway_pid(stack: Stack) -> int:
    want = str(Path(stack.config.state_dir).parent / "stockade.yaml")
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gateway" in argv and want.encode() in argv:
            return int(d.name)
    raise AssertionError("the stack's gateway process was not found")


def test_a_stopped_dns_firewall_is_detected(stack: Stack,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pid = _gateway_pid(stack)

    def breaks(rec: Any) -> Callable[[], None]:
        os.kill(pid, signal.SIGSTOP)  # the gateway's process, with its DNS firewall
        return lambda: os.kill(pid, signal.SIGCONT)

    _sabotage(monkeypatch, stack, breaks)
    _refused(stack, "dns_denied_name", "outside_resolver")


def test_a_route_around_the_gateway_is_detected(stack: Stack,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    raw = stack.config.launcher.selftest.raw_ip

    def breaks(rec: Any) -> Callable[[], None]:
        # the raw address routed out of another interface of the sandbox instead of
        # through the host side of its veth (a veth pair inside the namespace: what takes
        # that path goes nowhere)
        for cmd in ("link add byp0 type veth peer name byp1", "link set byp0 up",
                    "link set byp1 up", f"route add {raw}/32 dev byp0"):
            subprocess.run(["ip", "-n", rec.netns, *cmd.split()], check=True)
        return lambda: None  # the namespace goes with the sandbox

    _sabotage(monkeypatch, stack, breaks)
    _refused(stack, "raw_ip", "udp")


def test_a_widened_set_element_is_detected(stack: Stack,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    table, raw = stack.config.launcher.nft_table, stack.config.launcher.selftest.raw_ip

    def breaks(rec: Any) -> Callable[[], None]:
        # the broker's exemption from the redirect widened to another address
        elem = {"concat": [rec.ifname, raw]}
        _nft_element("add", table, nft.SET_HOST, elem)
        return lambda: _nft_element("delete", table, nft.SET_HOST, elem)

    _sabotage(monkeypatch, stack, breaks)
    _refused(stack, "exempt_port_elsewhere")


def _gvisor_or_skip(stack: Stack) -> None:
    from stockade.launcher.backends.gvisor import BACKEND

    why = BACKEND.problem(stack.config.launcher)
    if why is not None:
        pytest.skip(f"gVisor unavailable: {why}")


def test_a_gvisor_fence_is_probed_while_runsc_waits_at_its_gate(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """gVisor's runsc boots behind its start gate while the probes run: a holding fence
    passes and the command then runs; a broken one (the redirect deleted) refuses the
    start, its gate never opened, and nothing of the sandbox is left."""
    _gvisor_or_skip(stack)
    res = stack.run(["sh", "-c", "echo ran"], profile="agent-gv")
    assert (res.exit_code, res.stdout.strip()) == (0, "ran"), res.stderr
    start = next(e for e in read_events(stack.config.events_file)
                 if e.get("labels", {}).get("task_id") == res.task_id
                 and e["stockade"].get("lifecycle") == "start")
    assert start["stockade"]["selftest"]["passed"] is True, start["stockade"]["selftest"]
    table = stack.config.launcher.nft_table

    def breaks(rec: Any) -> Callable[[], None]:
        _nft_element("delete", table, nft.SET_IFS, rec.ifname)
        return lambda: _nft_element("add", table, nft.SET_IFS, rec.ifname)

    _sabotage(monkeypatch, stack, breaks)
    _refused(stack, "tls_denied_name", "raw_ip", profile="agent-gv")


def test_a_microvm_is_probed_from_inside_its_guest(stack: Stack, tmp_path: Path) -> None:
    """The same probes and verdicts as the other tiers, run through the guest's agent
    before the one-shot command; the record carries them."""
    out = tmp_path / "out"
    out.mkdir()
    res = stack.launcher.run(SandboxSpec("agent-vm", ["sh", "-c", "echo ran"],
                                         export_dir=str(out)), stack.ruleset)
    assert res.exit_code == 0 and res.stdout.strip() == "ran", res.stdout + res.stderr
    assert res.denials == []  # the probes' denials are not the command's
    start = next(e for e in read_events(stack.config.events_file)
                 if e.get("labels", {}).get("task_id") == res.task_id
                 and e["stockade"].get("lifecycle") == "start")
    st = start["stockade"]["selftest"]
    assert st["passed"] is True, st
    names = {p["probe"] for p in st["probes"]}
    assert {"dns_denied_name", "tls_denied_name", "outside_resolver", "raw_ip", "udp",
            "host_service", "exempt_port_elsewhere", "ipv6", "allowed_name"} <= names, names
    import base64

    env = json.loads((out / "stockade-record.json").read_text())
    record = json.loads(base64.b64decode(env["payload"]))
    assert record["selftest"]["passed"] is True and "skipped" not in record["selftest"]
    assert record["isolation"]["isolation"] == "microvm"


def test_a_microvm_session_is_probed_before_its_agent_serves_it(stack: Stack) -> None:
    """A session guest's agent runs the probes first, then serves the session's execs."""
    import threading

    from stockade.launcher.execspec import ExecSpec

    box: dict[str, Any] = {}
    known = {r["task_id"] for r in stack.launcher.list()}
    t = threading.Thread(target=lambda: box.update(res=stack.launcher.run(
        SandboxSpec("agent-vm", ["true"], session=True), stack.ruleset)), daemon=True)
    t.start()
    new = eventually(lambda: [r["task_id"] for r in stack.launcher.list()
                              if r["task_id"] not in known and r["state"] == "running"],
                     timeout=240)
    assert new, "the session did not start"
    try:
        proc = stack.launcher.exec(new[0], ExecSpec(("sh", "-c", "echo served")))
        assert proc.stdout is not None
        assert proc.stdout.read() == b"served\n" and proc.wait(timeout=120) == 0
        start = next(e for e in read_events(stack.config.events_file)
                     if e.get("labels", {}).get("task_id") == new[0]
                     and e["stockade"].get("lifecycle") == "start")
        assert start["stockade"]["selftest"]["passed"] is True, start["stockade"]["selftest"]
    finally:
        stack.launcher.kill(new[0])
        t.join(timeout=60)


def test_a_broken_microvm_fence_is_detected(stack: Stack,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade.launcher import vmprobes

    table = stack.config.launcher.nft_table
    real = vmprobes.run_in_guest

    def probes(link: Any, python: str, plan: Any, timeout: float) -> Any:
        rec = next(r for r in stack.launcher.state.read().values()
                   if r.profile == "agent-vm")
        _nft_element("delete", table, nft.SET_IFS, rec.ifname)  # the tap's redirect
        try:
            return real(link, python, plan, timeout)
        finally:
            _nft_element("add", table, nft.SET_IFS, rec.ifname)

    monkeypatch.setattr(vmprobes, "run_in_guest", probes)
    _refused(stack, "tls_denied_name", "raw_ip", profile="agent-vm")


@pytest.fixture(autouse=True)
def _no_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack" in request.fixturenames:
        assert request.getfixturevalue("stack").launcher.list() == []


def test_a_namespace_the_probes_cannot_enter_fails_closed(tmp_path: Path) -> None:
    import types

    from stockade.launcher.addresses import slot_addresses
    from stockade.launcher.settings import LauncherSettings
    from stockade.launcher.state import SandboxRecord

    events: list[dict[str, Any]] = []
    config = types.SimpleNamespace(launcher=LauncherSettings(), task_events_dir=tmp_path,
                                   gateway=None, broker=None)
    f = fence.Fence(config, 8090, events.append, lambda rec: None, lambda: True)
    a = slot_addresses("10.213.0.0/16", 1)
    rec = SandboxRecord("t0", "p", 1, "nope0", "stockade-no-such-netns", a.host_ip,
                        a.guest_ip, a.guest_mac)
    with pytest.raises(LauncherError, match=r"fence_unverified.*setup"):
        f.check(rec, types.SimpleNamespace(allow=()), a, tap=False, policy_version=None)
    assert [e["event"]["reason"] for e in events] == [FENCE_UNVERIFIED]
    assert "cannot make probe sockets in netns stockade-no-such-netns" in events[0]["message"]
    assert f.pop("t0") is None
