"""The microVM backend with real QEMU (TCG: KVM guests hang on the development VMs), real
netns, nftables and cgroups: a profile with `isolation: microvm` runs its command in a VM.

Each VM boot costs seconds under TCG, so one boot checks many things where it can."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from polling import eventually, wait_until
from stockade.launcher import LauncherError, SandboxSpec, vmimage

from stockade.events import validate
from stockade.trust import TRUST_ENV_VARS

from .conftest import Lab
from .test_launcher_escapes import NET_PROBES, PROMPT, both_spoofs_reported
from .test_launcher_leak import EMPTY, leftovers
from .test_launcher_sandbox import check_ro_binds_with_etc

pytestmark = [pytest.mark.netns, pytest.mark.slow]

GUEST = r"""
import errno, json, os, socket, subprocess, sys, urllib.request
""" + NET_PROBES + r"""def write(p):
    try:
        open(p, "w").write("x")
        return "WROTE"
    except OSError as e:
        return err(e)
ip, udp_ip, udp_port, dns_ip = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
os.makedirs("/scratch/out", exist_ok=True)
json.dump({"ok": True}, open("/scratch/out/result.json", "w"))
out = {
    "uid": os.getuid(), "gid": os.getgid(), "cwd": os.getcwd(),
    "env": sorted(os.environ), "home": os.environ["HOME"],
    "hostname": socket.gethostname(), "stdin": sys.stdin.read(),
    "resolv": open("/etc/resolv.conf").read(),
    "etc": sorted(os.listdir("/etc")),
    "input_file": open("/inputs/f.txt").read(),
    "input_dir": sorted(os.listdir("/inputs/d")),
    "writes": [write(p) for p in ("/usr/x", "/etc/x", "/inputs/d/x", "/x", "/scratch/ok",
                                  "/tmp/ok")],
    "kernel_cmdline": open("/proc/cmdline").read(),
    "broker": urllib.request.urlopen(os.environ["STOCKADE_BROKER"] + "/v1/whoami",
                                     timeout=10).read().decode(),
    "direct_tcp": tcp(ip, 443),
    "udp": udp(udp_ip, udp_port),
    "dns": udp(dns_ip, 53, b"\x12\x34query"),
    "caps": [l for l in open("/proc/self/status") if l.startswith(("CapEff", "CapBnd"))],
    "sysctl": {k: open("/proc/sys/" + k).read().strip() for k in (
        "kernel/modules_disabled", "user/max_user_namespaces", "kernel/kptr_restrict",
        "kernel/dmesg_restrict", "kernel/unprivileged_bpf_disabled", "kernel/modprobe")},
    "userns": subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode,
    "ld_env": os.environ.get("LD_BIND_NOW"),
}
print(json.dumps(out))
print("to-stderr", file=sys.stderr)
sys.exit(3)
"""


def _vm_proc_gone(task_id: str) -> bool:
    # QEMU's argv names the sandbox's own directories: no QEMU of it may outlive the
    # sandbox (matched on QEMU's own command line, not a wrapper's that names the paths)
    return subprocess.run(["pgrep", "-f", rf"^\S*qemu-system-\S+ .*/{task_id}/"],
                          capture_output=True).returncode == 1


def test_command_runs_in_a_microvm(lab: Lab, fake_internet: Any, tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "a.txt").write_text("a")
    (tmp_path / "f.txt").write_text("input file")
    for p in (tmp_path, data, data / "a.txt", tmp_path / "f.txt"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    ip = fake_internet.addresses["allowed.test"]
    udp_ip, udp_port = fake_internet.udp_echo
    export = tmp_path / "export"
    res = lab.launcher.run(SandboxSpec(
        "vm", ["python3", "-c", GUEST, ip, udp_ip, str(udp_port), fake_internet.dns_server],
        inputs=[(str(tmp_path / "f.txt"), "/inputs/f.txt"), (str(data), "/inputs/d")],
        stdin=b"from stdin", env={"EXTRA": "1", "LD_BIND_NOW": "1"},
        export_dir=str(export)), lab.ruleset)
    assert (res.exit_code, res.ended_by) == (3, "exit"), res.stderr
    assert res.stderr == "to-stderr\n"
    out = json.loads(res.stdout)
    # the sandbox user, no capabilities, the netns backend's environment and /etc
    assert (out["uid"], out["gid"], out["cwd"], out["home"]) == (
        65534, 65534, "/scratch", "/scratch/home")
    assert all(line.split()[1] == "0000000000000000" for line in out["caps"])
    assert set(out["env"]) <= {"PATH", "HOME", "TMPDIR", "STOCKADE_BROKER", "LANG", "LC_ALL",
                               "TERM", "TZ", "PWD", "EXTRA", "LD_BIND_NOW", *TRUST_ENV_VARS}
    # a loader variable reaches the command (after the drop), never the root init
    assert out["ld_env"] == "1"
    # the guest kernel's surface: no modules (nor a modprobe helper), no user namespaces,
    # no kernel pointers or log, no unprivileged BPF
    assert out["sysctl"] == {
        "kernel/modules_disabled": "1", "user/max_user_namespaces": "0",
        "kernel/kptr_restrict": "2", "kernel/dmesg_restrict": "1",
        "kernel/unprivileged_bpf_disabled": "1", "kernel/modprobe": ""}
    assert out["userns"] != 0  # unshare -Ur fails
    assert out["hostname"] == "sandbox" and out["stdin"] == "from stdin"
    assert out["resolv"].startswith("nameserver <infra-address>")
    assert "shadow" not in out["etc"] and "resolv.conf" in out["etc"]
    assert (out["input_file"], out["input_dir"]) == ("input file", ["a.txt"])
    assert out["writes"][:4] == ["ERR:EROFS"] * 4 and out["writes"][4:] == ["WROTE"] * 2
    assert "scratch" not in out["kernel_cmdline"] and "10.2" not in out["kernel_cmdline"]
    # the network: the broker sees the guest's address as the task; TCP to any address
    # lands on the gateway's port; UDP is rejected and reported; DNS reaches the firewall
    assert out["broker"] == res.task_id
    assert out["direct_tcp"] == "GW\n"
    assert out["udp"] in PROMPT
    assert out["dns"] == "\x12\x34LAB-DNS"
    start = lab.events(res.task_id)[0]
    assert start["stockade"]["lifecycle"] == "start"
    assert start["stockade"]["isolation"] == "microvm"
    assert "isolation_requested" not in start["stockade"]
    guest_ip = start["source"]["ip"]
    assert (guest_ip, ip, 443) in lab.obs.tcp
    bypass = [e for e in lab.bypass(res.task_id) if e["network"]["transport"] == "udp"
              and e["destination"]["ip"] == udp_ip]
    assert bypass and bypass[0]["source"]["ip"] == guest_ip
    validate(bypass[0])
    assert any(d["event"]["action"] == "bypass_attempt" for d in res.denials)
    # exports: the scratch is the same tmpfs as the netns backend's
    assert [(e.name, e.type) for e in res.exports] == [("result.json", "json")]
    assert json.loads((export / "result.json").read_text()) == {"ok": True}
    assert leftovers(lab) == EMPTY
    assert _vm_proc_gone(res.task_id)


def test_inputs_cannot_shadow_what_the_guest_init_runs(lab: Lab, tmp_path: Path) -> None:
    """The review's demonstrations: a forged plan (uid 0) on the config share's mount point,
    a fake python3 where the guest's root init finds its interpreter. Both are refused
    before anything exists, in both backends; so are the other paths the init relies on."""
    forged = tmp_path / "cfg"
    forged.mkdir()
    (forged / "plan").write_bytes(b"forged")
    fake = tmp_path / "python3"
    fake.write_text("#!/sbx/busybox sh\nid\n")
    fake.chmod(0o755)
    cases = [(str(forged), "/sbx/cfg"), (str(tmp_path), "/usr/bin"),
             (str(fake), "/usr/bin/python3"), (str(fake), "/etc/ld.so.preload"),
             (str(fake), "/lib64/ld-linux-x86-64.so.2"), (str(fake), "/init")]
    for profile in ("vm", "test"):
        for host, guest in cases:
            with pytest.raises(LauncherError, match="which the sandbox's init relies on"):
                lab.launcher.run(SandboxSpec(profile, ["true"], inputs=[(host, guest)]),
                                 lab.ruleset)
    assert leftovers(lab) == EMPTY


def test_an_input_reached_through_a_symlink_is_refused_in_the_guest(lab: Lab,
                                                                     tmp_path: Path) -> None:
    """An input directory holding a symlink to /usr, a second input below that symlink:
    the launcher sees only /inputs paths, the guest's init finds the target resolves onto
    /usr and refuses before anything runs."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "b").symlink_to("/usr")
    for p in (tmp_path, d):
        p.chmod(0o755)
    res = lab.launcher.run(SandboxSpec("vm", ["touch", "/scratch/ran"], inputs=[
        (str(d), "/inputs/d"), (str(tmp_path), "/inputs/d/b/lib")]), lab.ruleset)
    # the guest's start-up failure: status 125 with the reason, the command never ran
    assert res.exit_code == 125, res.stderr
    assert "goes through a symlink" in res.stderr
    assert leftovers(lab) == EMPTY
    # the netns backend's init (root, still in the host's tree while it builds the root):
    # a symlink to a host directory must not make it create anything there
    victim = tmp_path / "victim"
    victim.mkdir()
    (d / "v").symlink_to(victim)
    (tmp_path / "f").write_text("x")
    res = lab.launcher.run(SandboxSpec("test", ["true"], inputs=[
        (str(d), "/inputs/d"), (str(tmp_path / "f"), "/inputs/d/v/planted"),
        ]), lab.ruleset)
    assert res.exit_code == 125 and "goes through a symlink" in res.stderr, res.stderr
    assert list(victim.iterdir()) == []
    assert leftovers(lab) == EMPTY
    assert _vm_proc_gone(res.task_id)


def _background(lab: Lab, argv: list[str], **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    t, box = lab.background(argv, "vm", start_timeout=20.0, **kw)
    assert box["isolation"] == "microvm"  # what `stockade sandbox list` shows
    return t, box


# an IPv4 UDP datagram (header with its checksum) carrying b"spoof": both spoofing
# scripts below put it in an Ethernet frame of their own
IPV4_UDP = r"""
import socket, struct
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff)
    return ~(s + (s >> 16)) & 0xffff
def ipv4_udp(src_ip, dst_ip, port):
    payload = b"spoof"
    u = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
    h = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(u), 1, 0, 64, 17, 0,
                    socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    return h[:10] + struct.pack("!H", csum(h)) + h[12:] + u
"""

SPOOF = IPV4_UDP + r"""
import sys
def frame(src_mac, src_ip, dst_ip, port):
    return (bytes.fromhex(sys.argv[1].replace(":", "")) + bytes.fromhex(src_mac.replace(":", ""))
            + b"\x08\x00" + ipv4_udp(src_ip, dst_ip, port))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
guest_ip, guest_mac, dst, port = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
for _ in range(3):
    s.send(frame(guest_mac, "10.9.9.9", dst, port))         # forged address, own MAC
    s.send(frame("02:66:66:66:66:66", guest_ip, dst, port + 1))  # own address, forged MAC
"""


def test_suspend_resume_spoof_and_kill(lab: Lab, fake_internet: Any) -> None:
    """A running VM: suspended and resumed (cgroup freezer on QEMU), frames with a forged
    source address or MAC sent from the netns end of the veth (behind the tap's filter:
    the host's own guard must hold too; frames from inside the guest are
    test_a_root_guest_cannot_spoof_or_map_the_host's) are dropped and reported by the
    host's rules, then a kill removes everything."""
    t, box = _background(lab, ["sh", "-c", "touch /scratch/started; exec sleep 600"])
    tid = box["task_id"]
    s = lab.config.launcher
    started = Path(s.scratch_dir, tid, "scratch", "started")
    # the guest boots (seconds under TCG); no timing is asserted
    eventually(lambda: started.exists() or not t.is_alive(), timeout=60)
    try:
        assert started.exists(), "the guest's command did not start"
        # QEMU: pid 1 of a pid namespace of its own, in a mount namespace of its own, as
        # the sandbox user
        pids = [p for p in lab.launcher._live[tid].cg.pids()
                if Path(f"/proc/{p}/comm").read_text().startswith("qemu")]
        assert len(pids) == 1, pids
        status = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pids[0]}/status").read_text().splitlines())
        assert status["NSpid"].split() == [str(pids[0]), "1"]
        assert status["Uid"].split()[0] == str(s.sandbox_uid)
        assert os.readlink(f"/proc/{pids[0]}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        # its /proc is its pid namespace's: only itself
        procs = [n for n in os.listdir(f"/proc/{pids[0]}/root/proc") if n.isdigit()]
        assert procs == ["1"], procs
        # the host side answers ARP only for its own address on the veth
        rec = lab.launcher.state.read()[tid]
        for knob in ("arp_ignore", "arp_announce"):
            assert Path(f"/proc/sys/net/ipv4/conf/{rec.ifname}/{knob}").read_text() == "2\n"
        assert lab.launcher.suspend(tid)
        assert [r["state"] for r in lab.launcher.list()] == ["frozen"]
        assert lab.launcher.resume(tid)
        rec = lab.launcher.state.read()[tid]
        host_mac = Path(f"/sys/class/net/{rec.ifname}/address").read_text().strip()
        ip, port = fake_internet.udp_echo
        spoof = subprocess.run(
            ["ip", "netns", "exec", rec.netns, "python3", "-c", SPOOF, host_mac,
             rec.guest_ip, rec.guest_mac, ip, str(port)], capture_output=True, text=True,
            timeout=30)
        assert spoof.returncode == 0, spoof.stderr
        wait_until(lambda: both_spoofs_reported(lab, tid, rec.guest_ip, port),
                   what="the forged frames' bypass events")
    finally:
        assert lab.launcher.kill(tid)
        t.join(timeout=60)
    res = box["result"]
    assert (res.ended_by, res.exit_code) == ("killed", 137)
    spoofed = [e for e in lab.bypass(tid) if e["rule"]["id"] == "launcher:spoof"]
    assert any(e["source"]["ip"] == "10.9.9.9" for e in spoofed), lab.bypass(tid)
    assert any(e["source"]["ip"] == rec.guest_ip and e["destination"]["port"] == port + 1
               for e in spoofed), spoofed
    # nothing forged got past the guard (it would have been rejected as "blocked")
    assert not any(e["rule"]["id"] == "launcher:blocked" for e in lab.bypass(tid))
    lifecycle = [e["stockade"]["lifecycle"] for e in lab.events(tid)
                 if e["event"]["action"] == "sandbox_lifecycle"]
    assert lifecycle == ["start", "suspend", "resume", "kill", "end", "record"]
    assert leftovers(lab) == EMPTY
    assert _vm_proc_gone(tid)


# stands in for guest_init.py (test-only, through the launcher's own hook for its source):
# a guest that regained root, with raw sockets, on the guest's real eth0 behind the tap
ROOT_GUEST = IPV4_UDP + r"""
import marshal, os, time
out = os.open("/sbx/port-stdout", os.O_WRONLY)
plan = marshal.load(open("/sbx/run/plan", "rb"))
net = plan["net"]
os.spawnv(os.P_WAIT, "/sbx/busybox", ["ip", "link", "set", "eth0", "up"])
def udp(src_mac, src_ip, dst_ip, port):
    return b"\xff" * 6 + src_mac + b"\x08\x00" + ipv4_udp(src_ip, dst_ip, port)
def arp(src_mac, src_ip, target):
    a = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, src_mac, socket.inet_aton(src_ip),
                    b"\0" * 6, socket.inet_aton(target))
    return b"\xff" * 6 + src_mac + b"\x08\x06" + a
try:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0806))
    s.bind(("eth0", 0))
    mac = s.getsockname()[4]
    forged = bytes.fromhex("026666666666")
    dst, port = DST, PORT
    time.sleep(0.5)
    for _ in range(3):
        s.send(udp(mac, "10.9.9.9", dst, port))           # forged address, own MAC
        s.send(udp(forged, net["ip"], dst, port + 1))     # own address, forged MAC
        for t in [net["gateway"], *TARGETS]:
            s.send(arp(mac, net["ip"], t))                # who has each host address?
        s.send(arp(mac, "10.9.9.9", net["gateway"]))     # forged ARP sender
        s.send(arp(forged, net["ip"], net["gateway"]))   # forged ARP sender MAC
    s.settimeout(0.2)
    seen = set()
    end = time.time() + 3
    while time.time() < end:
        try:
            f = s.recv(2048)
        except OSError:
            continue
        if f[12:14] == b"\x08\x06" and f[20:22] == b"\x00\x02":
            seen.add((socket.inet_ntoa(f[28:32]), socket.inet_ntoa(f[38:42])))
    for who, to in sorted(seen):
        os.write(out, ("ARP-REPLY %s %s\n" % (who, to)).encode())
    os.write(out, b"DONE\n")
except Exception as e:
    os.write(out, ("ERR %r\n" % (e,)).encode())
os.write(os.open("/sbx/port-status", os.O_WRONLY), b"0 0 0\n")
os.execv("/sbx/busybox", ["reboot", "-f"])
"""


def test_a_root_guest_cannot_spoof_or_map_the_host(lab: Lab, fake_internet: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw frames from inside the guest (a stand-in init runs as the guest's root): a forged
    source address with the guest's MAC passes the tap's filter and is dropped and
    reported by the host's guard; a forged MAC never leaves the sandbox's netns (no
    event: the tap's ingress filter passes only the guest's MAC); ARP is answered only for
    the host side's address of this sandbox (arp_ignore=2; other host addresses, a forged
    ARP sender: no answer)."""
    from stockade.launcher.backends import microvm as vm_backend

    ip, port = fake_internet.udp_echo
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                         check=True).stdout
    targets = sorted({f.split()[3].split("/")[0] for f in out.splitlines()}
                     - {"127.0.0.1"})[:16]
    src = (ROOT_GUEST.replace("DST", repr(ip)).replace("PORT", str(port))
           .replace("TARGETS", repr(targets)))
    monkeypatch.setattr(vm_backend, "_guest_init_source", lambda: src)
    res = lab.launcher.run(SandboxSpec("vm", ["true"]), lab.ruleset)
    assert res.exit_code == 0 and "DONE" in res.stdout, res.stdout
    guest_ip = lab.events(res.task_id)[0]["source"]["ip"]
    replies = [line.split()[1:] for line in res.stdout.splitlines()
               if line.startswith("ARP-REPLY")]
    # the scrubber hides the host side's address in output: only it answered, to the guest
    assert replies == [["<infra-address>", guest_ip]], res.stdout
    bypass = lab.bypass(res.task_id)
    spoofed = [e for e in bypass if e["rule"]["id"] == "launcher:spoof"]
    assert any(e["source"]["ip"] == "10.9.9.9" for e in spoofed), bypass
    assert not any(e.get("destination", {}).get("port") == port + 1 for e in bypass), bypass
    assert not any(e["rule"]["id"] == "launcher:blocked" for e in bypass), bypass
    assert leftovers(lab) == EMPTY


def test_ttl_ends_a_looping_guest(lab: Lab) -> None:
    res = lab.launcher.run(SandboxSpec("vm", ["sh", "-c", "while :; do :; done"], ttl=8),
                           lab.ruleset)
    assert (res.ended_by, res.exit_code) == ("ttl", 137)
    end = [e for e in lab.events(res.task_id) if e["stockade"].get("lifecycle") == "end"]
    assert end[0]["event"]["reason"] == "ttl_expired"
    assert leftovers(lab) == EMPTY
    assert _vm_proc_gone(res.task_id)


def test_a_bad_kernel_is_a_clear_error_and_leaves_nothing(lab: Lab, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    good = lab.config.launcher.microvm.image_dir
    bad = tmp_path / "image"
    bad.mkdir()
    (bad / vmimage.KERNEL).write_bytes(b"\x7fELF not a kernel" * 100)
    shutil.copy(Path(good, vmimage.INITRD), bad / vmimage.INITRD)
    (bad / vmimage.MANIFEST).write_text(json.dumps({"stamp": "broken"}))
    strict = lab.launcher.s
    lab.launcher.s = strict.model_copy(update={"microvm": strict.microvm.model_copy(
        update={"image_dir": str(bad)})})
    try:
        with caplog.at_level("WARNING", logger="stockade.launcher"), \
                pytest.raises(LauncherError, match="the microVM failed") as failed:
            lab.launcher.run(SandboxSpec("vm", ["true"]), lab.ruleset)
        # the orchestrator gets no host path (QEMU's line names the kernel's); the
        # launcher's log keeps the raw line
        assert str(tmp_path) not in str(failed.value) and "/sbx/" not in str(failed.value)
        assert "microVM ended without a status" in caplog.text
        # a kernel that vanished after the check: refused with how to build it
        (bad / vmimage.MANIFEST).unlink()
        with pytest.raises(LauncherError, match=r"vm-images/build\.sh"):
            lab.launcher.run(SandboxSpec("vm", ["true"]), lab.ruleset)
    finally:
        lab.launcher.s = strict
    assert leftovers(lab) == EMPTY


def test_image_build_is_idempotent_and_atomic(tmp_path: Path) -> None:
    """vm-images/build.sh into a directory of the test's own (never the shared image): two
    concurrent builds take turns (one builds, the other then finds it up to date), the
    image is a symlink to one complete build, and a third run changes nothing."""
    image_dir = tmp_path / "vm"
    script = vmimage.BUILD_SCRIPT
    # a crashed build's temporary directory goes; another OUT_DIR's ("vm.x") build stays
    (tmp_path / ".vm.0123456789abcdef.tmp").mkdir()
    (tmp_path / ".vm.x.0123456789abcdef").mkdir()
    procs = [subprocess.Popen(["bash", str(script), str(image_dir)], stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert sorted("up to date" in e for e in errs) == [False, True], errs
    assert image_dir.is_symlink()
    build = image_dir.resolve()
    assert build.parent == tmp_path and build.name.startswith(".vm.")

    def files() -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in image_dir.iterdir()}

    before = files()
    again = subprocess.run(["bash", str(script), str(image_dir)], check=True,
                           capture_output=True, text=True)
    assert "up to date" in again.stderr
    assert files() == before and image_dir.resolve() == build
    assert set(before) == {vmimage.KERNEL, vmimage.INITRD, vmimage.MANIFEST}
    # nothing half-built is left next to it: the build, its lock (and the other OUT_DIR's)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [build.name, ".vm.lock", "vm", ".vm.x.0123456789abcdef"])
    image = vmimage.load_image(str(image_dir))
    assert image.kernel == str(build / vmimage.KERNEL)
    assert image.stamp and json.loads((build / vmimage.MANIFEST).read_text())["modules"]


def test_a_failed_image_build_changes_nothing(tmp_path: Path) -> None:
    """A build that cannot finish (here: a busybox that is not static) says why, exits
    non-zero (scripts/bootstrap.sh then warns and goes on) and leaves the image in place."""
    old = tmp_path / ".vm.previous"
    old.mkdir()
    (tmp_path / "vm").symlink_to(".vm.previous")
    res = subprocess.run(["bash", str(vmimage.BUILD_SCRIPT), str(tmp_path / "vm")],
                         capture_output=True, text=True,
                         env={**os.environ, "STOCKADE_VM_BUSYBOX": "/bin/sh"})
    assert res.returncode != 0 and "not a static binary" in res.stderr
    assert os.readlink(tmp_path / "vm") == ".vm.previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".vm.lock", ".vm.previous", "vm"]


def test_accel_auto_is_probed_once_and_cached(lab: Lab, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    image = vmimage.load_image(lab.config.launcher.microvm.image_dir)
    cache = tmp_path / "accel.json"
    qemu = lab.config.launcher.microvm.qemu
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        assert vmimage.resolve_accel("auto", qemu, image, cache, timeout_s=5) == "tcg"
        assert not cache.exists()
        return
    # the real probe boot (KVM guests hang on the development VMs: a timeout there)
    assert vmimage.probe_kvm(qemu, image, 5) in ("ok", "failed", "timeout")
    calls: list[object] = []

    def slow_timeout(*a: object) -> str:
        calls.append(a)
        time.sleep(0.3)  # a slow probe: the other threads reach the flock meanwhile
        return "timeout"

    # concurrent first sandboxes: one probe (under the flock), every one gets its answer
    monkeypatch.setattr(vmimage, "probe_kvm", slow_timeout)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(
        vmimage.resolve_accel("auto", qemu, image, cache, timeout_s=5))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ["tcg"] * 4 and len(calls) == 1
    entry = json.loads(cache.read_text())
    assert (entry["accel"], entry["probe"]) == ("tcg", "timeout")
    assert entry["expires_at"] > time.time()

    def no_probe(*a: object) -> str:
        raise AssertionError("probed again")

    # the next run uses the cached answer
    monkeypatch.setattr(vmimage, "probe_kvm", no_probe)
    assert vmimage.resolve_accel("auto", qemu, image, cache, timeout_s=5) == "tcg"
    # a timed-out answer expires (a loaded host is not stuck with TCG): probed again
    cache.write_text(json.dumps({**entry, "expires_at": time.time() - 1}))
    monkeypatch.setattr(vmimage, "probe_kvm", lambda *a: "ok")
    assert vmimage.resolve_accel("auto", qemu, image, cache, timeout_s=5) == "kvm"
    assert json.loads(cache.read_text())["expires_at"] is None  # a success is kept
    monkeypatch.setattr(vmimage, "probe_kvm", no_probe)
    assert vmimage.resolve_accel("auto", qemu, image, cache, timeout_s=5) == "kvm"
    # another image (another key) is probed anew; a configured accel never probes
    other = vmimage.Image(image.kernel, image.initrd, "another-stamp")
    with pytest.raises(AssertionError, match="probed again"):
        vmimage.resolve_accel("auto", qemu, other, cache, timeout_s=5)
    assert vmimage.resolve_accel("tcg", qemu, image, cache, timeout_s=5) == "tcg"


CRASHER = r"""
import json, sys, types
from stockade.config import Config
from stockade.launcher import Launcher, SandboxSpec
from stockade.policy.model import Limits, Profile
cfg = Config.model_validate(json.loads(sys.argv[1]))
rs = types.SimpleNamespace(profiles={"vm": Profile("vm", "t", isolation="microvm",
                                                   selftest="sampled",
                                                   limits=Limits(ttl=60))}, version="x")
Launcher(cfg, nflog=False).run(SandboxSpec("vm", ["sleep", "60"]), rs)
"""


def _running_vm(lab: Lab) -> str | None:
    """The one sandbox's task id once it is running and its QEMU has exec'd."""
    rows = lab.launcher.list()
    if rows and rows[0]["state"] == "running" and not _vm_proc_gone(rows[0]["task_id"]):
        return str(rows[0]["task_id"])
    return None


def test_reconcile_removes_a_crashed_launchers_vm(lab: Lab) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CRASHER,
                             json.dumps(lab.config.model_dump())])
    tid = None
    try:
        try:
            # "running" is recorded once the sh/nsenter/unshare chain is spawned; QEMU
            # itself execs a moment later (longer on a loaded host): wait for QEMU
            tid = eventually(lambda: _running_vm(lab), timeout=30, interval=0.01)
            assert tid is not None and not _vm_proc_gone(tid), \
                "the crasher did not start its microVM"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        left = leftovers(lab)
        assert left["netns"] and left["cgroups"] and left["state"]  # the crash left pieces
        assert not _vm_proc_gone(tid)  # and QEMU runs on (its own session)
        removed = lab.launcher.reconcile()
        assert removed["sandboxes"] == [tid]
        assert leftovers(lab) == EMPTY
        assert _vm_proc_gone(tid)
    finally:  # a failure here must not leave the crash to the next test's leftovers check
        lab.launcher.reconcile()


def test_fork_bomb_in_the_guest_hits_the_profiles_pids_limit(lab: Lab) -> None:
    """The profile's pids limit holds inside the guest (QEMU's own threads are counted in
    the host cgroup instead): a fork bomb ends the sandbox with `limit`, not at the TTL."""
    res = lab.launcher.run(SandboxSpec("vm", ["sh", "-c", "f() { f | f & }; f; sleep 60"],
                                       ttl=120), lab.ruleset)
    assert res.ended_by == "limit", (res.exit_code, res.stderr)
    end = [e for e in lab.events(res.task_id) if e["stockade"].get("lifecycle") == "end"]
    assert end[0]["event"]["reason"] == "resource_limit"
    assert leftovers(lab) == EMPTY
    assert _vm_proc_gone(res.task_id)


def test_ro_binds_with_etc_keeps_the_host_etc_in_a_microvm(lab: Lab) -> None:
    """Listing /etc in ro_binds shares the host's /etc with the generated resolv.conf,
    hosts and hostname over it, as in the netns backend."""
    check_ro_binds_with_etc(lab, "vm")


def test_the_profiles_cpu_limit_holds_in_the_guest(lab: Lab) -> None:
    """The command's cgroup in the guest has the profile's CPU quota before the command's
    first instruction; QEMU's host cgroup holds the VM's vCPUs (here one), so the guest's
    start and the emulation are not charged to the task's half CPU."""
    from stockade.launcher import Launcher
    from stockade.launcher.backends.microvm import MicrovmBackend

    made: list[Any] = []
    live = SimpleNamespace(cg=SimpleNamespace(create=lambda limits, **_: made.append(limits)))
    MicrovmBackend().create(live, lab.ruleset.profiles["vm-half"].limits,  # type: ignore[arg-type]
                            lab.config.launcher)
    assert made[0].cpus == 1.0
    assert isinstance(lab.launcher, Launcher)
    res = lab.launcher.run(SandboxSpec("vm-half", [
        "sh", "-c", "cat /proc/self/cgroup /sbx/cg/task/cpu.max"]), lab.ruleset)
    assert (res.exit_code, res.stdout) == (0, "0::/task\n50000 100000\n"), res.stderr
    assert leftovers(lab) == EMPTY


def test_output_cap_and_a_memory_bomb_in_the_guest(lab: Lab) -> None:
    """max_output_bytes holds for the guest's stdout (the rest is drained, the guest never
    stalls), and a memory bomb is OOM-killed by the guest's cgroup of limits.memory:
    `limit`, not a failed VM."""
    from stockade.launcher import Launcher

    ls = lab.config.launcher
    cfg = lab.config.model_copy(update={"launcher": ls.model_copy(
        update={"max_output_bytes": 1024})})
    other = Launcher(cfg, nflog=False)
    try:
        res = other.run(SandboxSpec("vm", ["sh", "-c",
                                           "head -c 3000000 /dev/zero | tr '\\0' x; "
                                           "echo drained >&2; python3 -c 'b = []\n"
                                           "while True: b.append(bytearray(1 << 20))'"]),
                        lab.ruleset)
    finally:
        other.close()
    assert res.stdout == "x" * 1024
    assert res.stderr.startswith("drained\n")
    assert (res.ended_by, res.exit_code) == ("limit", 137), res.stderr
    assert leftovers(lab) == EMPTY
