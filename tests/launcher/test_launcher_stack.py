"""The launcher with the real gateway and broker (`stockade gateway serve`, `stockade broker
serve` as subprocesses) and the fake internet: the allowed path works end to end through
the transparent redirect and the DNS firewall, and what the gateway, DNS firewall and broker
deny shows up in the run's `denials` under the task id."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from polling import eventually
from stockade.launcher import Launcher, RunResult, SandboxSpec
from stockade.launcher.cgroups import remove_parent
from stockade.launcher.selftest import without_probe_events

from stockade.config import Config, load_config
from stockade.events import validate
from stockade.ports import free_dual_port, free_port
from stockade.tasks import ControlClient

pytestmark = [pytest.mark.netns, pytest.mark.slow]

PROFILE = """\
profile: agent
description: launcher stack test
isolation: container
limits: {cpus: 1, memory: 256MiB, disk: 64MiB, pids: 128, ttl: 60s}
egress:
  mode: enforce
  allow:
    - host: allowed.test
      ports: [443, 80]
      reason: the stack test's allowed site
    - host: echo.test
      ports: [443]
      reason: read-only, decided per request by the gateway's L7 inspector
      http: {methods: [GET], paths: ["/echo"]}
exports: {max_file: 1MiB, max_total: 2MiB, types: [text, json]}
"""
# the same, for a tool that only works with an explicit proxy
PROXY_PROFILE = PROFILE.replace("profile: agent", "profile: agent-proxy").replace(
    "  mode: enforce\n", "  mode: enforce\n  proxy_env: true\n")
# the same rules in a microVM
VM_PROFILE = PROFILE.replace("profile: agent", "profile: agent-vm").replace(
    "isolation: container", "isolation: microvm")
# and under gVisor
GV_PROFILE = PROFILE.replace("profile: agent", "profile: agent-gv").replace(
    "isolation: container", "isolation: gvisor")


class Stack:
    def __init__(self, config: Config, launcher: Launcher, ruleset: Any, ca: str) -> None:
        self.config = config
        self.launcher = launcher
        self.ruleset = ruleset
        self.ca = ca

    def run(self, argv: list[str], profile: str = "agent") -> RunResult:
        res = self.launcher.run(SandboxSpec(profile, argv, inputs=[(self.ca, "/inputs/ca.pem")]),
                                self.ruleset)
        for ev in res.denials:
            validate(ev)
        return res


def _wait_healthy(path: str, proc: subprocess.Popen[bytes], name: str) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"{name} exited: {err}")
        try:
            inspector = ControlClient(path, timeout=1).health().get("inspector")
        except OSError:
            return False
        # the gateway's L7 inspector too (inspected flows fail until then)
        return not isinstance(inspector, dict) or bool(inspector.get("ready"))

    if not eventually(healthy, timeout=30):
        raise RuntimeError(f"{name} did not become healthy")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, fake_internet: Any) -> Iterator[Stack]:
    from stockade.policy import load_rules

    tmp = tmp_path_factory.mktemp("stack")
    rules = tmp / "rules"
    for d in ("profiles", "apis", "presets", "tests"):
        (rules / d).mkdir(parents=True)
    (rules / "profiles" / "agent.yaml").write_text(PROFILE)
    (rules / "profiles" / "agent-proxy.yaml").write_text(PROXY_PROFILE)
    (rules / "profiles" / "agent-vm.yaml").write_text(VM_PROFILE)
    (rules / "profiles" / "agent-gv.yaml").write_text(GV_PROFILE)
    (tmp / "token").write_text("not-a-real-token")
    sfx = secrets.token_hex(3)
    octet = 100 + secrets.randbelow(100)
    cfg_data = {
        "rules_dir": str(rules), "state_dir": str(tmp / "state"), "log_dir": str(tmp / "log"),
        "run_dir": str(tmp / "run"), "events": {"file": str(tmp / "log" / "events.jsonl")},
        "gateway": {"transparent_listen": [f"0.0.0.0:{free_port('0.0.0.0')}"],
                    # every address: the agent-proxy sandboxes reach it on their veth address
                    "proxy_listen": [f"0.0.0.0:{free_port('0.0.0.0')}"],
                    "control_socket": str(tmp / "run" / "gateway.sock"),
                    "metrics_listen": f"127.0.0.1:{free_port('0.0.0.0')}",
                    "resolvers": [fake_internet.dns_server],
                    "allow_addresses": [fake_internet.subnet],
                    # the inspector verifies the fake internet's certificates upstream
                    "inspection": {"upstream_ca_file": fake_internet.ca_pem}},
        "dns": {"listen": [f"0.0.0.0:{free_dual_port()}"]},
        "broker": {"listen": f"0.0.0.0:{free_port('0.0.0.0')}",
                   "control_socket": str(tmp / "run" / "broker.sock"),
                   "metrics_listen": f"127.0.0.1:{free_port('0.0.0.0')}"},
        # the broker needs a Vault to be configured; none is needed for what is tested here
        "vault": {"address": "http://127.0.0.1:9", "token_file": str(tmp / "token")},
        "launcher": {"nft_table": f"stockade_ls{sfx}", "name_prefix": f"s{sfx[:3]}",
                     "cgroup_parent": f"stockade_ls{sfx}", "scratch_dir": str(tmp / "sbx"),
                     "address_pool": f"10.214.{octet}.0/24",
                     "nflog_group": 7200 + secrets.randbelow(99),
                     "microvm": {"accel": "tcg"},  # KVM guests hang on the development VMs
                     # the fence self-test's raw destinations: the fake internet's, so a
                     # broken fence (test_launcher_selftest.py) reaches nothing else
                     "selftest": {"raw_ip": fake_internet.udp_echo[0],
                                  "outside_resolver": fake_internet.dns_server}},
    }
    cfg_path = tmp / "stockade.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg_data))
    config = load_config(cfg_path)
    procs = []
    launcher = None
    try:
        for name in ("gateway", "broker"):
            p = subprocess.Popen([sys.executable, "-m", "stockade", name, "serve", "--config",
                                  str(cfg_path)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)
            procs.append(p)
            sock = config.gateway.control_socket if name == "gateway" \
                else config.broker.control_socket
            _wait_healthy(sock, p, name)
        launcher = Launcher(config)
        launcher.start()
        yield Stack(config, launcher, load_rules(rules), fake_internet.ca_pem)
    finally:
        if launcher is not None:
            launcher.close()
            launcher.reconcile()
        subprocess.run(["nft", "delete", "table", "inet", config.launcher.nft_table],
                       capture_output=True, check=False)
        remove_parent(config.launcher.cgroup_root, config.launcher.cgroup_parent)
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_allowed_site_through_gateway(stack: Stack) -> None:
    res = stack.run(["curl", "-sS", "--max-time", "10", "--cacert", "/inputs/ca.pem",
                     "https://allowed.test/"])
    assert res.exit_code == 0, res.stderr
    assert res.stdout
    assert res.denials == []


# what an inspected request and a refused one print: no --cacert, the sandbox's own trust
INSPECTED = ("curl -sS --max-time 10 https://echo.test/echo -o /dev/null "
             "-w 'inspected %{http_code}\\n'; "
             "curl -sS --max-time 10 -X POST -d x https://echo.test/echo -D - -o /dev/null "
             "| tr -d '\\r' | grep -i '^x-stockade-deny'")


def _inspected_ok(res: RunResult) -> None:
    """The sandbox trusted the inspector's certificate (no --cacert) and got the GET
    through; the POST was refused by the inspector with its reason header."""
    lines = res.stdout.lower().splitlines()
    assert "inspected 200" in lines, (res.stdout + res.stderr, res.denials)
    assert "x-stockade-deny: method_not_allowed" in lines, res.stdout + res.stderr
    assert any(e["event"]["action"] == "request_decision"
               and e["event"]["reason"] == "method_not_allowed" for e in res.denials), res.denials


def test_inspected_tls_flow_with_the_sandbox_trusting_the_inspection_ca(stack: Stack) -> None:
    res = stack.run(["sh", "-c", "echo ssl=$SSL_CERT_FILE; " + INSPECTED])
    assert "ssl=/etc/stockade-ca-bundle.pem" in res.stdout.splitlines(), res.stdout
    _inspected_ok(res)


def test_gateway_and_dns_denials_carry_the_task(stack: Stack, fake_internet: Any) -> None:
    ip = fake_internet.addresses["denied.test"]
    res = stack.run(["sh", "-c",
                     "curl -sS --max-time 5 --cacert /inputs/ca.pem https://denied.test/; "
                     f"curl -sS --max-time 5 -k https://{ip}/; "
                     f"curl -sS --max-time 5 http://{fake_internet.dns_server}:853/; true"])
    comps = {(e["stockade"]["component"], e["event"]["action"]) for e in res.denials}
    assert ("dns", "dns_decision") in comps, res.denials
    assert ("gateway", "connection_decision") in comps, res.denials
    assert all(e["labels"]["task_id"] == res.task_id for e in res.denials)


# a broker call for an API the profile does not allow: the broker answers 403 with its reason
BROKER_CALL = ("import json, os, urllib.request, urllib.error\n"
               "req = urllib.request.Request(os.environ['STOCKADE_BROKER'] + '/v1/call',"
               " data=json.dumps({'api': 'github', 'path': '/user'}).encode(),"
               " headers={'Content-Type': 'application/json'})\n"
               "try:\n    urllib.request.urlopen(req, timeout=10)\n"
               "except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())\n")


def test_broker_denial_in_result(stack: Stack) -> None:
    res = stack.run(["python3", "-c", BROKER_CALL])
    assert res.stdout.startswith("403"), res.stdout + res.stderr
    assert json.loads(res.stdout.split(" ", 1)[1])["reason"] == "api_not_allowed"
    assert any(e["stockade"]["component"] == "broker" for e in res.denials), res.denials


def test_udp_bypass_next_to_gateway(stack: Stack, fake_internet: Any) -> None:
    ip, port = fake_internet.udp_echo
    code = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"s.settimeout(3)\ns.connect(({ip!r}, {port}))\ns.send(b'x')\n"
            "try:\n    print(s.recv(10))\nexcept OSError as e:\n    print(type(e).__name__)\n")
    res = stack.run(["python3", "-c", code])
    assert "TimeoutError" not in res.stdout and "b'" not in res.stdout
    assert any(e["event"]["action"] == "bypass_attempt" for e in res.denials)
    assert Path(stack.config.events_file).exists()


def test_host_service_port_denied_by_gateway(stack: Stack) -> None:
    # the gateway's own metrics port on the host side of the veth: TCP is redirected to the
    # gateway, which refuses its own addresses; the metrics server never answers
    mport = stack.config.gateway.metrics_listen.rsplit(":", 1)[1]
    code = ("import os, urllib.request\n"
            "gw = os.environ['STOCKADE_BROKER'].split('//')[1].split(':')[0]\n"
            "try:\n"
            f"    print(urllib.request.urlopen(f'http://{{gw}}:{mport}/metrics', timeout=10)"
            ".read()[:40])\n"
            "except Exception as e:\n    print('refused', type(e).__name__)\n")
    res = stack.run(["python3", "-c", code])
    assert res.stdout.startswith("refused"), res.stdout
    gw = [e for e in res.denials if e["stockade"]["component"] == "gateway"]
    assert gw and gw[0]["destination"]["port"] == int(mport), res.denials


def _gateway_events(stack: Stack, task_id: str) -> list[dict[str, Any]]:
    from stockade.events import read_events

    # the fence self-test's probes are the task's too: left out, as from the run's denials
    evs = [e for e in without_probe_events(
               [e for e in read_events(stack.config.events_file)
                if e.get("labels", {}).get("task_id") == task_id])
           if e["stockade"]["component"] == "gateway"
           and e["event"]["action"] == "connection_decision"]
    for e in evs:
        validate(e)
    return evs


def _proxy_decisions(stack: Stack, task_id: str, want: int) -> list[dict[str, Any]]:
    # allowed flows' events are written by the gateway in a short batch: wait for them
    # (bounded; no timing is asserted)
    def proxied() -> list[dict[str, Any]]:
        return [e for e in _gateway_events(stack, task_id)
                if e["stockade"].get("listener") == "proxy"]

    eventually(lambda: len(proxied()) >= want, timeout=10)
    return proxied()


def test_proxy_env_profile_uses_the_explicit_proxy(stack: Stack) -> None:
    port = int(stack.config.gateway.proxy_listen[0].rsplit(":", 1)[1])
    # no --proxy: curl takes HTTPS_PROXY from the environment the launcher set
    res = stack.run(["sh", "-c",
                     "env | grep -i _proxy= | sort; "
                     "curl -sS --max-time 10 --cacert /inputs/ca.pem https://allowed.test/ "
                     "-o /scratch/body -w 'allowed %{http_code} %{http_connect}\\n'"],
                    profile="agent-proxy")
    assert res.exit_code == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    # the host-side address is scrubbed from the output; the port is the listener's
    url = f"http://<infra-address>:{port}"
    assert {k: env.get(k) for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
            } == dict.fromkeys(("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"), url)
    assert env["NO_PROXY"] == env["no_proxy"] == "<infra-address>"
    # 200 from the site, after a 200 to the CONNECT: the request went through the proxy
    assert "allowed 200 200" in lines, res.stdout
    assert res.denials == []
    evs = _proxy_decisions(stack, res.task_id, 1)
    assert evs, _gateway_events(stack, res.task_id)
    assert all(e["stockade"]["listener"] == "proxy" for e in _gateway_events(stack,
                                                                              res.task_id))
    ev = evs[0]
    assert ev["stockade"]["decision"] == "allowed"
    assert ev["destination"]["domain"] == "allowed.test" and ev["destination"]["port"] == 443
    # teardown removed the sandbox's exemption with its other elements
    from stockade.launcher import nft

    assert not any(nft.list_elements(stack.config.launcher.nft_table).get(n)
                   for n in nft.PER_SANDBOX_SETS)


def test_proxy_env_denial_is_a_403_from_the_proxy(stack: Stack) -> None:
    res = stack.run(["sh", "-c",
                     # https: the CONNECT is refused; -v shows the proxy's answer
                     "curl -sS -v --max-time 10 --cacert /inputs/ca.pem https://denied.test/ "
                     "2>&1 | grep -i -e '^< HTTP' -e '^< X-Stockade-Deny'; "
                     # plain http: the absolute-URI request is refused
                     "curl -sS -i --max-time 10 http://denied.test/; true"],
                    profile="agent-proxy")
    out = res.stdout
    assert out.count("X-Stockade-Deny: no_matching_rule") == 2, out
    lines = [line.rstrip("\r") for line in out.splitlines()]
    # the CONNECT's answer (curl -v) and the absolute-URI request's answer (curl -i)
    assert "< HTTP/1.1 403 Forbidden" in lines and "HTTP/1.1 403 Forbidden" in lines, out
    gw = [e for e in res.denials if e["stockade"]["component"] == "gateway"]
    assert len(gw) == 2 and {e["stockade"]["listener"] for e in gw} == {"proxy"}, res.denials
    assert {e["destination"]["domain"] for e in gw} == {"denied.test"}
    assert all(e["event"]["reason"] == "no_matching_rule" for e in gw)
    # the names were never looked up from the sandbox: the proxy resolves them
    assert not any(e["stockade"]["component"] == "dns" for e in res.denials), res.denials


def test_profile_without_proxy_env_has_no_proxy_variables(stack: Stack) -> None:
    port = int(stack.config.gateway.proxy_listen[0].rsplit(":", 1)[1])
    connect = "CONNECT allowed.test:443 HTTP/1.1\\r\\nHost: allowed.test:443\\r\\n\\r\\n"
    code = ("import os, socket\n"
            "print(sorted(k for k in os.environ if k.upper().endswith('_PROXY')))\n"
            "gw = os.environ['STOCKADE_BROKER'].split('//')[1].split(':')[0]\n"
            "try:\n"
            f"    s = socket.create_connection((gw, {port}), timeout=10)\n"
            f"    s.sendall(b'{connect}')\n"
            "    print(repr(s.recv(200)[:40]))\n"
            "except OSError as e:\n    print('refused', type(e).__name__)\n")
    res = stack.run(["python3", "-c", code])
    first, second = res.stdout.splitlines()[:2]
    assert first == "[]", res.stdout
    # the proxy port on its host-side address is redirected to the transparent listener,
    # as before the option existed: no explicit proxy answers the CONNECT
    assert "200" not in second, res.stdout + res.stderr
    gw = _gateway_events(stack, res.task_id)
    assert gw and all(e["stockade"]["listener"] == "transparent" for e in gw), gw


def test_microvm_guest_through_the_real_gateway(stack: Stack, fake_internet: Any) -> None:
    """One microVM: the allowed site through the transparent redirect and the DNS firewall;
    a denied name, a direct-IP connection and UDP denied, each reported under the task."""
    from stockade.events import read_events

    ip = fake_internet.addresses["denied.test"]
    udp_ip, udp_port = fake_internet.udp_echo
    udp = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
           f"s.settimeout(3)\ns.connect(({udp_ip!r}, {udp_port}))\ns.send(b'x')\n"
           "try:\n    print('udp', s.recv(10))\nexcept OSError as e:\n"
           "    print('udp', type(e).__name__)\n")
    res = stack.run(["sh", "-c",
                     "curl -sS --max-time 10 --cacert /inputs/ca.pem https://allowed.test/ "
                     "-o /dev/null -w 'allowed %{http_code}\\n'; "
                     "curl -sS --max-time 5 --cacert /inputs/ca.pem https://denied.test/ "
                     "|| echo denied-name; "
                     f"curl -sS --max-time 5 -k https://{ip}/ || echo denied-ip; "
                     f"python3 -c \"{udp}\"; "
                     # binaries run from the scratch share, like a build's own tools
                     "cp /bin/true /scratch/t && /scratch/t && echo exec-ok; "
                     + INSPECTED],
                    profile="agent-vm")
    lines = res.stdout.splitlines()
    assert "allowed 200" in lines, res.stdout + res.stderr
    assert {"denied-name", "denied-ip", "exec-ok"} <= set(lines), res.stdout + res.stderr
    _inspected_ok(res)
    assert "udp b'x'" not in lines
    comps = {(e["stockade"]["component"], e["event"]["action"]) for e in res.denials}
    assert {("dns", "dns_decision"), ("gateway", "connection_decision"),
            ("launcher", "bypass_attempt")} <= comps, res.denials
    assert all(e["labels"]["task_id"] == res.task_id for e in res.denials)
    # the name was refused by the DNS firewall: the gateway's denials are the direct IP's
    # (a ClientHello without a name) and the inspector's refusal of the POST
    assert [e["event"]["action"] for e in res.denials
            if e["stockade"]["component"] == "gateway"] == ["connection_decision",
                                                              "request_decision"], res.denials
    # (the fence self-test's probes, from inside the guest, came before the start event)
    start = next(e for e in read_events(stack.config.events_file)
                 if e.get("labels", {}).get("task_id") == res.task_id
                 and e["stockade"].get("lifecycle") == "start")
    assert start["stockade"]["isolation"] == "microvm"
    assert start["stockade"]["selftest"]["passed"] is True, start["stockade"]["selftest"]
    # every denial names the guest's address: the gateway identified the VM as the task
    assert {e["source"]["ip"] for e in res.denials} == {start["source"]["ip"]}


def test_gvisor_sandbox_through_the_real_gateway_and_broker(stack: Stack) -> None:
    """A gVisor sandbox: the allowed site, the inspected GET (the sandbox trusts the
    inspection CA) and a broker call, each seen under the task."""
    from stockade.launcher.backends.gvisor import BACKEND

    from stockade.events import read_events

    why = BACKEND.problem(stack.config.launcher)
    if why is not None:
        pytest.skip(f"gVisor unavailable: {why}")
    res = stack.run(["sh", "-c",
                     "curl -sS --max-time 10 --cacert /inputs/ca.pem https://allowed.test/ "
                     "-o /dev/null -w 'allowed %{http_code}\\n'; "
                     f"python3 -c \"{BROKER_CALL}\"; " + INSPECTED], profile="agent-gv")
    lines = res.stdout.splitlines()
    assert "allowed 200" in lines, res.stdout + res.stderr
    _inspected_ok(res)
    broker = [line for line in lines if line.startswith("403 ")]
    assert broker and json.loads(broker[0][4:])["reason"] == "api_not_allowed", lines
    assert any(e["stockade"]["component"] == "broker" for e in res.denials), res.denials
    start = next(e for e in read_events(stack.config.events_file)
                 if e.get("labels", {}).get("task_id") == res.task_id
                 and e["stockade"].get("lifecycle") == "start")
    assert start["stockade"]["isolation"] == "gvisor"
    assert {e["source"]["ip"] for e in res.denials} == {start["source"]["ip"]}
