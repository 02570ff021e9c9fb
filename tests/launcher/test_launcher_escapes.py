"""The escape matrix: each attempt runs inside a sandbox and is asserted blocked and reported.

TCP to anything (direct IP, DoT, host service ports, another sandbox) can only land on the
gateway's transparent port: the observer there records the original destination, and the
host service behind the port never sees the connection (the gateway reports and denies it;
tests/launcher/test_launcher_stack.py checks that with the real gateway). Everything that is
not TCP or DNS is rejected at once (never a hang) and reported as a `bypass_attempt` event.
Every test runs in the container tier (profile `test`) and in the gVisor tier (`gv`).
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from polling import wait_until
from stockade.launcher import RunResult

from stockade.events import validate

from .conftest import Lab, command_running, gvisor_command_running

pytestmark = pytest.mark.netns


# the probes both backends' escape tests run inside a sandbox (errno names, not texts)
NET_PROBES = r"""
def err(e):
    if isinstance(e, TimeoutError) or e.errno is None:
        return "ERR:timeout"
    return "ERR:" + errno.errorcode.get(e.errno, str(e.errno))
def tcp(h, p):
    try:
        s = socket.create_connection((h, p), timeout=5)
        return s.recv(16).decode("latin1")
    except OSError as e:
        return err(e)
def udp(h, p, data=b"x"):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        s.connect((h, p)); s.send(data); s.send(data)
        return s.recv(100).decode("latin1")
    except OSError as e:
        return err(e)
"""

PROBE = r"""
import errno, json, os, socket, sys
GW = os.environ["STOCKADE_BROKER"].split("//")[1].split(":")[0]  # host side of the veth
""" + NET_PROBES + r"""def icmp(h):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
        s.settimeout(3); s.connect((h, 0))
        for seq in (1, 2):
            s.send(b"\x08\x00\x00\x00\x00\x01\x00" + bytes([seq]) + b"xxxxxxxx")
        return s.recv(100).hex()
    except OSError as e:
        return err(e)
def tcp6(h, p):
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); s.settimeout(3)
        s.connect((h, p)); return "connected"
    except OSError as e:
        return err(e)
print(json.dumps(eval(sys.argv[1])))
"""

PROMPT = {"ERR:EHOSTUNREACH", "ERR:ECONNREFUSED", "ERR:EACCES", "ERR:EPERM", "ERR:ENETUNREACH"}


def probe(lab: Lab, expr: str, profile: str = "test") -> tuple[Any, RunResult]:
    res = lab.run(["python3", "-c", PROBE, expr], profile=profile)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout), res


def guest_ip(lab: Lab, res: RunResult) -> str:
    start = next(e for e in lab.events(res.task_id) if e["event"]["action"] == "sandbox_lifecycle")
    return str(start["source"]["ip"])


def assert_reported(lab: Lab, res: RunResult, dst: str, transport: str, port: int | None = None,
                    what: str = "blocked") -> dict[str, Any]:
    evs = [e for e in lab.bypass(res.task_id)
           if e.get("destination", {}).get("ip") == dst and e["network"]["transport"] == transport]
    assert evs, f"no bypass_attempt for {dst} {transport}: {lab.bypass(res.task_id)}"
    ev = evs[0]
    validate(ev)
    assert ev["event"]["kind"] == "alert" and ev["stockade"]["decision"] == "denied"
    assert ev["event"]["reason"] == "bypass_attempt" and ev["rule"]["id"] == f"launcher:{what}"
    assert ev["labels"]["profile"] == lab.events(res.task_id)[0]["labels"]["profile"]
    if port is not None:
        assert ev["destination"]["port"] == port
    # the same event is in the run's own result
    assert any(d.get("destination", {}).get("ip") == dst for d in res.denials)
    return ev


def test_direct_ip_tcp_lands_on_gateway_only(lab: Lab, fake_internet: Any, tier: str) -> None:
    ip = fake_internet.addresses["allowed.test"]
    out, res = probe(lab, f"tcp({ip!r}, 443)", tier)
    assert out == "GW\n"
    src = guest_ip(lab, res)
    assert (src, ip, 443) in lab.obs.tcp


def test_udp_rejected_and_reported(lab: Lab, fake_internet: Any, tier: str) -> None:
    ip, port = fake_internet.udp_echo
    out, res = probe(lab, f"udp({ip!r}, {port})", tier)
    assert out in PROMPT  # an answer from the echo server would be the escape
    ev = assert_reported(lab, res, ip, "udp", port)
    assert ev["source"]["ip"] == guest_ip(lab, res)


def test_icmp_rejected_and_reported(lab: Lab, fake_internet: Any, tier: str) -> None:
    ip = fake_internet.raw_echo_ip
    out, res = probe(lab, f"icmp({ip!r})", tier)
    assert out in PROMPT
    assert_reported(lab, res, ip, "icmp")


def test_outside_dns_goes_to_dns_firewall(lab: Lab, fake_internet: Any, tier: str) -> None:
    ip = fake_internet.dns_server
    before = len(lab.obs.dns)
    out, res = probe(lab, f"[udp({ip!r}, 53, b'\\x12\\x34query'), tcp({ip!r}, 53)]", tier)
    # both answers come from the host's DNS firewall port, not the outside resolver
    assert out[0] == "\x12\x34LAB-DNS"
    assert out[1].endswith("LAB-DNS!!")
    src = guest_ip(lab, res)
    assert {(src, "udp"), (src, "tcp")} <= set(lab.obs.dns[before:])


def test_dot_853_only_reaches_gateway(lab: Lab, fake_internet: Any, tier: str) -> None:
    ip = fake_internet.dns_server
    out, res = probe(lab, f"tcp({ip!r}, 853)", tier)
    assert out == "GW\n"
    assert (guest_ip(lab, res), ip, 853) in lab.obs.tcp


def test_host_service_ports(lab: Lab, tier: str) -> None:
    # a host service listening on all addresses (like metrics or Vault would)
    code = (f"[tcp(GW, {lab.trap_port}), tcp(GW, 22), udp(GW, {lab.trap_port}), "
            "tcp('127.0.0.1', 9464)]")
    before = len(lab.obs.trap)
    out, res = probe(lab, code, tier)
    assert out[0] == "GW\n" and out[1] == "GW\n"  # redirected, the service never saw it
    assert lab.obs.trap[before:] == []
    assert out[2] in PROMPT  # UDP to the host: rejected
    assert out[3] == "ERR:ECONNREFUSED"  # the sandbox's loopback is its own
    host_ip = next(e for e in lab.bypass(res.task_id))["destination"]["ip"]
    assert_reported(lab, res, host_ip, "udp", lab.trap_port)


def _background(lab: Lab, argv: list[str],
                tier: str) -> tuple[threading.Thread, dict[str, Any]]:
    t, box = lab.background(argv, profile=tier)
    # "running" is the record: wait for its init to reach the command
    tid, comm = box["task_id"], argv[0]
    wait_until(lambda: gvisor_command_running(lab, tid, comm) if tier == "gv"
               else command_running(tid, comm), what=f"{comm} in the sandbox")
    return t, box


def _finish(lab: Lab, t: threading.Thread, box: dict[str, Any]) -> RunResult:
    lab.launcher.kill(box["task_id"])
    t.join(timeout=20)
    res: RunResult = box["result"]
    assert res.ended_by == "killed"
    return res


def test_other_sandbox_unreachable(lab: Lab, tier: str) -> None:
    victim_code = ("import socket,time\nu=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                   "u.bind(('0.0.0.0',9999))\nu.settimeout(8)\n"
                   "try:\n  d,p=u.recvfrom(10); u.sendto(b'LEAK',p); print('got',p)\n"
                   "except OSError: pass\n")
    t, box = _background(lab, ["python3", "-c", victim_code], tier)
    victim = box["address"]
    try:
        out, res = probe(lab, f"[udp({victim!r}, 9999), icmp({victim!r}), tcp({victim!r}, 22)]",
                         tier)
    finally:
        vres = _finish(lab, t, box)
    assert out[0] in PROMPT and out[1] in PROMPT
    assert out[2] == "GW\n"  # TCP to a neighbour only reaches the gateway
    assert "got" not in vres.stdout
    assert_reported(lab, res, victim, "udp", 9999)
    assert_reported(lab, res, victim, "icmp")


def _netns_of(lab: Lab, task_id: str) -> str:
    return f"{lab.config.launcher.name_prefix}-{task_id}"


def _as_root_in(ns: str, script: str) -> None:
    # stands for a sandbox that somehow regained CAP_NET_ADMIN: the host side must still hold
    subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", script], check=False,
                   capture_output=True, timeout=20)


def test_ipv6_disabled_and_dropped(lab: Lab, fake_internet: Any, tier: str) -> None:
    v6 = fake_internet.ipv6_address
    out, _ = probe(lab, f"tcp6({v6!r}, 443)", tier)
    assert out in PROMPT | {"ERR:EADDRNOTAVAIL", "ERR:EAFNOSUPPORT"}
    t, box = _background(lab, ["sleep", "30"], tier)
    ns = _netns_of(lab, box["task_id"])
    try:
        _as_root_in(ns, "sysctl -qw net.ipv6.conf.all.disable_ipv6=0 "
                        "net.ipv6.conf.eth0.disable_ipv6=0; "
                        "ip -6 addr add fd00:5::2/64 dev eth0 nodad; "
                        "ip -6 route add default dev eth0; "
                        "python3 -c \"import socket; s=socket.socket(socket.AF_INET6,"
                        "socket.SOCK_DGRAM); [s.sendto(b'x', ('fd00:5::1', 53)) "
                        "for _ in range(3)]\"")
        wait_until(lambda: [e for e in lab.bypass(box["task_id"])
                            if e["rule"]["id"] == "launcher:ipv6"
                            and e.get("source", {}).get("ip") == "fd00:5::2"],
                   what="the IPv6 packets' bypass events")
    finally:
        res = _finish(lab, t, box)
    evs = [e for e in lab.bypass(res.task_id) if e["rule"]["id"] == "launcher:ipv6"]
    assert evs, lab.bypass(res.task_id)
    # the first packets are neighbour solicitations for fd00:5::1; all are reported
    assert any(e.get("source", {}).get("ip") == "fd00:5::2" for e in evs), evs
    assert all(e["network"]["transport"] in ("udp", "ipv6-icmp", "other") for e in evs)


def both_spoofs_reported(lab: Lab, task_id: str, address: str, port: int) -> bool:
    """Both forged sends reported: the foreign address, and the own address from a
    foreign MAC (to the echo port + 1)."""
    spoof = [e for e in lab.bypass(task_id) if e["rule"]["id"] == "launcher:spoof"]
    return (any(e["source"]["ip"] == "10.9.9.9" for e in spoof)
            and any(e["source"]["ip"] == address and e["destination"]["port"] == port + 1
                    for e in spoof))


def test_spoofed_source_address_and_mac(lab: Lab, fake_internet: Any, tier: str) -> None:
    # the sandbox user cannot even try: no raw sockets, no address changes
    res0 = lab.run(["python3", "-c", "import socket; socket.socket(2, 3, 255)"], profile=tier)
    assert res0.exit_code != 0 and "PermissionError" in res0.stderr
    res1 = lab.run(["ip", "addr", "add", "10.9.9.9/32", "dev", "eth0"], profile=tier)
    assert res1.exit_code != 0
    ip, port = fake_internet.udp_echo
    t, box = _background(lab, ["sleep", "30"], tier)
    ns = _netns_of(lab, box["task_id"])
    rec = lab.launcher.state.read()[box["task_id"]]
    host_mac = Path(f"/sys/class/net/{rec.ifname}/address").read_text().strip()
    try:
        # the host side answers no ARP from a sender outside the sandbox's /30
        # (arp_ignore=2): a regained root resolves it from its own address first, which
        # leaves the same neighbour entry as this
        _as_root_in(ns, f"ip neigh replace {rec.host_ip} lladdr {host_mac} dev eth0 "
                        "nud permanent; "
                        "ip addr add 10.9.9.9/32 dev eth0; python3 -c \"import socket; "
                        "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); "
                        f"s.bind(('10.9.9.9',0)); s.sendto(b'x', ('{ip}', {port}))\"; "
                        "ip link set eth0 address 02:66:66:66:66:66; "
                        f"python3 -c \"import socket; socket.socket(2,2).sendto(b'y', "
                        f"('{ip}', {port + 1}))\"")
        wait_until(lambda: both_spoofs_reported(lab, box["task_id"], box["address"], port),
                   what="the spoofed packets' bypass events")
    finally:
        res = _finish(lab, t, box)
    spoof = [e for e in lab.bypass(res.task_id) if e["rule"]["id"] == "launcher:spoof"]
    assert any(e["source"]["ip"] == "10.9.9.9" for e in spoof), lab.bypass(res.task_id)
    # right address, wrong MAC: dropped as spoofed as well
    assert any(e["source"]["ip"] == box["address"] and e["destination"]["port"] == port + 1
               for e in spoof)
    # and nothing spoofed was answered by the echo server: it never left the host
    assert not any(e["rule"]["id"] == "launcher:blocked" and e["source"]["ip"] == "10.9.9.9"
                   for e in lab.bypass(res.task_id))


def test_write_to_input_and_outside_scratch(lab: Lab, tier: str) -> None:
    data = lab.tmp / "input-data"
    data.mkdir(exist_ok=True)
    (data / "f.txt").write_text("original")
    data.chmod(0o755)
    (data / "f.txt").chmod(0o666)  # writable by anyone on the host: the mount still refuses
    script = ("for p in /inputs/d/f.txt /inputs/d/new /usr/x /etc/x /x /proc/sys/kernel/hostname "
              "/dev/x; do (echo pwn > $p) 2>/dev/null && echo WROTE $p || echo DENIED $p; done; "
              "echo ok > /scratch/ok && echo WROTE /scratch/ok; cat /inputs/d/f.txt")
    res = lab.run(["sh", "-c", script], inputs=[(str(data), "/inputs/d")], profile=tier)
    lines = res.stdout.splitlines()
    assert [x for x in lines if x.startswith("WROTE")] == ["WROTE /scratch/ok"]
    assert lines[-1] == "original", res
    assert (data / "f.txt").read_text() == "original" and not (data / "new").exists()
