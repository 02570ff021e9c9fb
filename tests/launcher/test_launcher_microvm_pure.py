"""The microVM backend's pure core: backend choice, QEMU argv, kernel command line, guest
plan and mount table, sizing, the netns wiring commands, the status line."""

from __future__ import annotations

import marshal
from pathlib import Path

import pytest
from stockade.launcher import microvm, netns, vmimage
from stockade.launcher.isolation import decide_backend
from stockade.launcher.settings import LauncherSettings
from stockade.launcher.spec import LauncherError

MIB = 2**20


def _spec(**kw: object) -> microvm.VmSpec:
    base: dict[str, object] = dict(
        qemu="/usr/bin/qemu-system-x86_64", accel="tcg", kernel="/img/vmlinux",
        initrd="/img/initramfs.cpio.gz", memory_mib=128, cpus=1, mac="02:00:0a:d5:00:02",
        cfg_dir="/sbx/t/cfg",
        layout=microvm.Layout((microvm.Share("sys0", "/usr", "/usr"),
                               microvm.Share("scratch", "/sbx/t/scratch", "/scratch",
                                             readonly=False)),
                              (("link", "usr/bin", "/bin"),)),
        console="/proc/self/fd/5", ports=("/proc/self/fd/6", "/proc/self/fd/7",
                                          "/proc/self/fd/8"),
        tsc_khz=2300000, runas=(65534, 65534))
    base.update(kw)
    return microvm.VmSpec(**base)  # type: ignore[arg-type]


def test_backend_per_isolation_tier() -> None:
    s = LauncherSettings()
    assert decide_backend(s, "p", "container", None) == ("netns", {"isolation": "container"})
    assert decide_backend(s, "p", "microvm", None) == ("microvm", {"isolation": "microvm"})
    with pytest.raises(LauncherError, match=r"microVM backend is unavailable here: no image.*"
                       r"downgrade_isolation"):
        decide_backend(s, "p", "microvm", "no image")
    with pytest.raises(LauncherError, match=r"gVisor backend \(runsc\) is unavailable here: "
                       r"runsc \(runsc\) is not installed.*downgrade_isolation"):
        decide_backend(s, "p", "gvisor", "runsc (runsc) is not installed")
    assert decide_backend(s, "p", "gvisor", None) == ("gvisor", {"isolation": "gvisor"})
    with pytest.raises(LauncherError, match="no sgx backend exists"):
        decide_backend(s, "p", "sgx", None)
    down = s.model_copy(update={"downgrade_isolation": ["gvisor", "microvm"]})
    assert decide_backend(down, "p", "microvm", "no image") == (
        "netns", {"isolation": "container", "isolation_requested": "microvm"})
    assert decide_backend(down, "p", "gvisor", "x")[1]["isolation_requested"] == "gvisor"
    # a working microVM backend is used even when a downgrade would be accepted
    assert decide_backend(down, "p", "microvm", None)[0] == "microvm"


def test_qemu_argv() -> None:
    argv = microvm.qemu_argv(_spec())
    joined = " ".join(argv)
    # no legacy PIT, PIC, option ROMs; the RTC (the guest's wall clock under TCG) stays
    assert argv[:3] == ["/usr/bin/qemu-system-x86_64", "-M",
                        "microvm,pit=off,pic=off,x-option-roms=off"]
    for flag in ("-nodefaults", "-no-user-config", "-nographic", "-no-reboot"):
        assert flag in argv
    assert argv[argv.index("-accel") + 1] == "tcg,tb-size=256"
    assert argv[argv.index("-m") + 1] == "128M"
    assert "tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off,vnet_hdr=off" in argv
    assert "virtio-net-device,netdev=net0,mac=02:00:0a:d5:00:02" in argv
    # the config share is read-only and first; the scratch is the only writable share
    assert "local,id=fs0,path=/sbx/t/cfg,security_model=none,readonly=on,multidevs=remap" in argv
    assert "virtio-9p-device,fsdev=fs0,mount_tag=stockade-cfg" in argv
    assert joined.count("readonly=off") == 1 and "path=/sbx/t/scratch" in joined
    for nr, name in enumerate(microvm.PORT_NAMES, start=1):
        assert f"virtserialport,chardev={name},name={name},nr={nr}" in argv
    assert argv[argv.index("-runas") + 1] == "65534:65534"
    assert argv[argv.index("-sandbox") + 1].startswith("on,")
    kvm = microvm.qemu_argv(_spec(accel="kvm", runas=None, seccomp=False))
    assert kvm[kvm.index("-accel") + 1] == "kvm" and kvm[kvm.index("-cpu") + 1] == "host"
    assert "-runas" not in kvm and "-sandbox" not in kvm and "-run-with" not in kvm
    with pytest.raises(ValueError, match="QEMU option"):
        microvm.qemu_argv(_spec(cfg_dir="/a,b"))


def test_privilege_drop_in_the_qemu_versions_spelling() -> None:
    # QEMU 10.0 refuses -runas (gone since 8.1's -run-with); 7.2 knows only -runas
    new = microvm.qemu_argv(_spec(run_with=True))
    assert new[new.index("-run-with") + 1] == "user=65534:65534" and "-runas" not in new
    assert "-run-with" not in microvm.qemu_argv(_spec(run_with=False))
    assert microvm.qemu_argv(_spec(run_with=True, runas=None)).count("-run-with") == 0


def test_firmware_named_when_the_host_has_qboot() -> None:
    # Debian's QEMU 10 has no bios-microvm.bin: its microvm would boot SeaBIOS instead
    argv = microvm.qemu_argv(_spec(bios="/usr/share/qemu/qboot.rom"))
    assert argv[argv.index("-bios") + 1] == "/usr/share/qemu/qboot.rom"
    assert argv.index("-bios") < argv.index("-kernel")
    assert "-bios" not in microvm.qemu_argv(_spec())


def test_kernel_cmdline_has_no_task_data() -> None:
    line = microvm.kernel_cmdline("tcg", 2300000)
    assert "panic=-1" in line and "reboot=t" in line and "ipv6.disable=1" in line
    assert "tsc_early_khz=2300000" in line
    assert "tsc_early_khz" not in microvm.kernel_cmdline("kvm", 2300000)
    argv = microvm.qemu_argv(_spec())
    append = argv[argv.index("-append") + 1]
    assert append == line  # nothing of the task (argv, env, addresses) on the command line
    assert "10." not in append and "scratch" not in append


def test_guest_plan_is_plain_data() -> None:
    plan = microvm.guest_plan(
        argv=["sh", "-c", "echo $HOME; rm -rf / #'\""], env={"A": "b c"}, uid=65534,
        gid=65534, rlimits={"NOFILE": 4096}, guest_ip="10.0.0.2", host_ip="10.0.0.1",
        prefixlen=30, memory=64 * MIB, pids=64, pids_fail_kill=32, stdin=False, cpus=0.5)
    assert marshal.loads(microvm.encode_plan(plan)) == plan  # noqa: S302 - our own bytes
    assert plan["argv"][2] == "echo $HOME; rm -rf / #'\""
    assert plan["net"] == {"ip": "10.0.0.2", "prefixlen": 30, "gateway": "10.0.0.1"}
    assert plan["cpu_max"] == "50000 100000"  # the command's cgroup in the guest
    # the guest checks its input table against these again
    assert {"/sbx", "/usr", "/etc", "/lib64", "/scratch"} <= set(plan["reserved"])
    for bad in ({"argv": []}, {"uid": 0}, {"gid": 0}):
        kw = dict(argv=["true"], env={}, uid=1000, gid=1000, rlimits={}, guest_ip="a",
                  host_ip="b", prefixlen=30, memory=1, pids=1, pids_fail_kill=1,
                  stdin=False, cpus=1.0)
        kw.update(bad)
        with pytest.raises(ValueError):
            microvm.guest_plan(**kw)  # type: ignore[arg-type]


def test_a_session_guest_gets_its_agent_port_and_modules() -> None:
    assert not any("agent" in a for a in microvm.qemu_argv(_spec()))  # one-shot: no agent
    argv = microvm.qemu_argv(_spec(agent_fd=9))
    # a connected socket (no path anyone could reach), after the three output ports
    assert "socket,id=agent,fd=9" in argv
    assert "virtserialport,chardev=agent,name=agent,nr=4" in argv
    assert "virtio-serial-device,max_ports=5" in argv
    kw = dict(argv=[], env={}, uid=1000, gid=1000, rlimits={}, guest_ip="a", host_ip="b",
              prefixlen=30, memory=1, pids=1, pids_fail_kill=1, stdin=False, cpus=1.0)
    plan = microvm.guest_plan(**kw, session_modules=[("vmchannel", "X = 1\n")])  # type: ignore[arg-type]
    assert (plan["session"], plan["modules"]) == (True, [("vmchannel", "X = 1\n")])
    assert marshal.loads(microvm.encode_plan(plan)) == plan  # noqa: S302 - our own bytes
    with pytest.raises(ValueError, match="empty command"):  # no command, no session
        microvm.guest_plan(**kw)  # type: ignore[arg-type]


def test_mount_table() -> None:
    layout = microvm.Layout(
        (microvm.Share("sys0", "/usr", "/usr"),
         microvm.Share("in0", "/data/my dir", "/inputs/my dir")),
        (("link", "usr/bin", "/bin"), ("bindrw", "/scratch/tmp", "/tmp"),
         ("tmpfs", "16777216", "/dev/shm")))
    assert microvm.mount_table(layout) == (
        "9p sys0 ro /usr\n9p in0 ro /inputs/my dir\nlink usr/bin /bin\n"
        "bindrw /scratch/tmp /tmp\ntmpfs 16777216 /dev/shm\n")
    for bad in (microvm.Layout((microvm.Share("sys0", "/usr", "/a\nb"),)),
                microvm.Layout((microvm.Share("Bad Tag", "/usr", "/usr"),)),
                microvm.Layout((), (("exec", "x", "/y"),)),
                microvm.Layout((), (("link", "a b", "/y"),)),
                microvm.Layout((microvm.Share("sys0", "/usr", "/a/../etc"),))):
        with pytest.raises(ValueError):
            microvm.mount_table(bad)


def test_sizing() -> None:
    assert microvm.guest_memory_mib(64 * MIB, 64) == 128
    assert microvm.guest_memory_mib(64 * MIB + 1, 64) == 129
    assert microvm.host_memory_limit(64 * MIB, 8 * MIB, 64, 192) == (128 + 192 + 8) * MIB
    # the TCG translation cache is QEMU's memory too, on top of its own
    assert microvm.host_memory_limit(64 * MIB, 8 * MIB, 64, 192, 256) == (
        128 + 192 + 256 + 8) * MIB
    assert [microvm.vcpus(c) for c in (0.25, 1.0, 1.5, 2)] == [1, 1, 2, 2]


def test_status_line() -> None:
    assert microvm.parse_status("7 0 0\n") == (7, 0, 0)
    assert microvm.parse_status("137 1 0") == (137, 1, 0)
    for bad in ("", "7", "x 0 0", "300 0 0", "7 0 0 0"):
        assert microvm.parse_status(bad) is None


def test_netns_wiring_for_a_vm() -> None:
    cmds = netns.tap_commands("tap0")
    assert "tuntap add dev tap0 mode tap" in cmds
    assert not any("addr add" in c for c in cmds)  # the netns itself holds no address
    from stockade.launcher.addresses import slot_addresses

    a = slot_addresses("10.213.0.0/16", 0x7a00 // 4)
    assert (a.host_ip, a.guest_ip, a.guest_mac) == ("10.213.122.1", "10.213.122.2",
                                                   "02:00:0a:d5:7a:02")
    tc = netns.mirred_commands("tap0", a)
    assert tc == [
        "qdisc add dev eth0 ingress",
        "filter add dev eth0 parent ffff: protocol all u32 match u32 0 0 "
        "action mirred egress redirect dev tap0",
        "qdisc add dev tap0 ingress",
        # towards the host: IPv4 from the guest's MAC, ARP from its MAC and address for the
        # host side's only; nothing else leaves the netns
        "filter add dev tap0 parent ffff: protocol ip prio 1 u32 match ether src "
        "02:00:0a:d5:7a:02 action mirred egress redirect dev eth0",
        "filter add dev tap0 parent ffff: protocol arp prio 2 u32 match ether src "
        "02:00:0a:d5:7a:02 match u16 0x0ad5 0xffff at 14 match u16 0x7a02 0xffff at 16 "
        "match u32 0x0ad57a01 0xffffffff at 24 action mirred egress redirect dev eth0",
    ]


def test_guest_layout() -> None:
    from stockade.launcher.initscript import Bind

    system = [Bind("/usr", "/usr"), Bind("/bin", "/bin", symlink_to="usr/bin"),
              Bind("/x.conf", "/x.conf", is_dir=False)]
    inputs = [Bind("/data/d", "/inputs/d"), Bind("/data/f.txt", "/inputs/f.txt", is_dir=False)]
    layout, copies = microvm.guest_layout(
        system=system, etc_dir="/s/etc", host_etc=False, host_etc_overlay=(),
        scratch="/s/scratch", inputs=inputs, staged_dir="/s/inputs", shm_size=4096)
    # vm-images/init's table never holds an input: guest_init.py mounts them from their own
    # table once it has read the plan
    assert microvm.mount_table(layout) == (
        "9p sys0 ro /usr\n9p etc ro /etc\n9p scratch rw /scratch\n9p inputs ro /sbx/in\n"
        "link usr/bin /bin\nbindrw /scratch/tmp /tmp\ntmpfs 4096 /dev/shm\n")
    assert microvm.input_table(layout) == "9p in0 /inputs/d\nbind /sbx/in/1 /inputs/f.txt\n"
    assert copies == [("/data/f.txt", "/s/inputs/1")]
    # QEMU still gets every share, the inputs' included
    argv = microvm.qemu_argv(_spec(layout=layout))
    assert "virtio-9p-device,fsdev=fs5,mount_tag=in0" in argv
    # the scratch is the only writable share
    assert [s.tag for s in layout.shares if not s.readonly] == ["scratch"]
    host, copies = microvm.guest_layout(
        system=system[:1], etc_dir="/s/etc", host_etc=True,
        host_etc_overlay=("resolv.conf", "hosts"), scratch="/s/scratch", inputs=[],
        staged_dir="/s/inputs", shm_size=4096)
    table = microvm.mount_table(host)
    assert "9p etc ro /etc\n9p etc-gen ro /sbx/etc\n" in table
    assert "bind /sbx/etc/resolv.conf /etc/resolv.conf\nbind /sbx/etc/hosts /etc/hosts\n" in table
    assert copies == [] and "/sbx/in" not in table


def test_a_failed_vms_reason_carries_no_host_path() -> None:
    from stockade.launcher import scrub
    from stockade.launcher.backends.microvm import scrub_vm_error as _scrub_vm_error

    raw = ("the microVM failed: qemu-system-x86_64: -fsdev local,id=fs3,path=/data/in put,"
           "security_model=none: cannot open '/var/cache/stockade/vm/.vm.1/vmlinux': "
           "(fd /proc/self/fd/5) from 10.1.2.3")
    got = _scrub_vm_error(raw, scrub.build(addresses=["10.1.2.3"]), "/var/cache/stockade/vm")
    assert got == ("the microVM failed: qemu-system-x86_64: -fsdev local,id=fs3,"
                   "path=<host-path> put,security_model=none: cannot open '<host-path>': "
                   "(fd <host-path>) from <infra-address>")


def test_snapshot_shapes_templates_and_restores() -> None:
    from stockade.launcher import vmsnapshot

    v = _spec(agent_fd=9)
    key = vmsnapshot.shape_key(v, "stamp")
    # the shape is the machine, never a sandbox's fds, MAC, console or host paths
    same = _spec(agent_fd=3, mac="02:00:0a:d5:00:06", console="/proc/self/fd/11",
                 cfg_dir="/sbx/u/cfg", layout=microvm.Layout(
                     (microvm.Share("sys0", "/usr", "/usr"),
                      microvm.Share("scratch", "/sbx/u/scratch", "/scratch", readonly=False)),
                     (("link", "usr/bin", "/bin"),)))
    assert vmsnapshot.shape_key(same, "stamp") == key
    for other in (_spec(memory_mib=256), _spec(cpus=2), _spec(layout=microvm.Layout()),
                  _spec(runas=None)):
        assert vmsnapshot.shape_key(other, "stamp") != key
    assert vmsnapshot.shape_key(v, "another image") != key
    t = vmsnapshot.template_spec(v, "/snap/empty", agent_fd=4, qmp_fd=5)
    argv = microvm.qemu_argv(t)
    joined = " ".join(argv)
    # the template's devices are the shape's; no host end of the sandbox stays
    assert "/sbx/t" not in joined and "/proc/self/fd" not in joined
    assert joined.count("path=/snap/empty") == 3  # cfg, /usr, scratch: same tags, same order
    assert argv[argv.index("-append") + 1].endswith(" stockade.template")
    assert "socket,id=qmp,fd=5" in argv and "socket,id=agent,fd=4" in argv
    assert f"mac={vmsnapshot.TEMPLATE_MAC}" in joined and "-incoming" not in argv
    r = microvm.qemu_argv(vmsnapshot.restore_spec(v, incoming_fd=7))
    assert r[r.index("-incoming") + 1] == "fd:7" and "qmp" not in " ".join(r)
    # a restored guest runs its template's kernel command line: the same -append
    assert r[r.index("-append") + 1] == argv[argv.index("-append") + 1]
    assert "mac=02:00:0a:d5:00:02" in " ".join(r)  # its own MAC (its plan sets it too)
    with pytest.raises(ValueError, match="agent port"):
        vmsnapshot.restore_spec(_spec(), incoming_fd=7)
    fresh = microvm.fresh_identity("02:00:0a:d5:00:02", b"s" * 64, 1.5)
    assert fresh == {"mac": "02:00:0a:d5:00:02", "seed": b"s" * 64, "clock": 1.5}
    with pytest.raises(ValueError, match="seed"):
        microvm.fresh_identity("02:00:0a:d5:00:02", b"short", 1.5)


def test_a_pooled_guests_plan_comes_on_its_agent_port() -> None:
    from pathlib import Path

    fresh = microvm.fresh_identity("02:00:0a:d5:00:02", b"s" * 64, 1.5)
    ahead = microvm.ahead(microvm.guest_plan(
        argv=["true"], env={}, uid=65534, gid=65534, rlimits={"NOFILE": 4096}, guest_ip="",
        host_ip="", prefixlen=0, memory=MIB, pids=8, pids_fail_kill=4, stdin=False, cpus=0.5))
    placeholder = microvm.pooled_plan([("vmchannel", "X = 1")], "10.213.0.2", "10.213.0.1",
                                      30, fresh, ahead, b"\1" * 16,
                                      (("/usr/bin/bash", "-c", ":"),))
    # no task in it: its slot's network and identity, the agent's modules, and what every
    # task of its pool runs under (the settings' user and rlimits, the shape's limits, the
    # filter of a profile that relaxes nothing, which its command's child loads ahead)
    assert marshal.loads(microvm.encode_plan(placeholder)) == {  # noqa: S302
        "pooled": True, "modules": [("vmchannel", "X = 1")], "fresh": fresh,
        "net": {"ip": "10.213.0.2", "prefixlen": 30, "gateway": "10.213.0.1"},
        "ahead": {"uid": 65534, "gid": 65534, "rlimits": {"NOFILE": 4096}, "memory": MIB,
                  "pids": 8, "cpu_max": "50000 100000", "hostname": "sandbox",
                  "congestion_control": None},
        "seccomp": b"\1" * 16, "warmup": [["/usr/bin/bash", "-c", ":"]],
        "warmup_locale": {}}
    # its warm-up runs under the locale its tasks get from the host (nothing else of it)
    assert microvm.pooled_plan([], "10.213.0.2", "10.213.0.1", 30, fresh, ahead, b"\1" * 8, (),
                               {"LANG": "C.UTF-8", "LC_CTYPE": "C", "TZ": "UTC"}
                               )["warmup_locale"] == {"LANG": "C.UTF-8", "LC_CTYPE": "C"}
    from stockade.launcher.settings import MicrovmSettings

    assert MicrovmSettings().pool_warmup == [["/usr/bin/bash", "-c", ":"]]
    for bad in ([[]], [["bash", "-c", ":"]], [["/bin/sh", "a\0b"]]):
        with pytest.raises(ValueError, match="absolute path"):
            MicrovmSettings(pool_warmup=bad)
    for bad in ({**ahead, "uid": 0}, {**ahead, "gid": 0}, {"uid": 1}):
        with pytest.raises(ValueError):
            microvm.pooled_plan([], "10.213.0.2", "10.213.0.1", 30, fresh, bad, b"\1" * 8)
    for no_filter in (b"", b"\1" * 7):  # its child would run a claim's command unfiltered
        with pytest.raises(ValueError, match="seccomp"):
            microvm.pooled_plan([], "10.213.0.2", "10.213.0.1", 30, fresh, ahead, no_filter)
    plan = {"argv": ["true"], "stdin_data": b"in"}
    frame = microvm.plan_frame(plan)
    n = int.from_bytes(frame[:4], "big")
    assert n == len(frame) - 4 and marshal.loads(frame[4:]) == plan  # noqa: S302
    with pytest.raises(ValueError, match="over"):
        microvm.plan_frame({"env": {"BIG": "x" * microvm.MAX_PLAN_BYTES}})
    # the guest's side (standalone: it imports nothing of the launcher) agrees
    src = (Path(microvm.__file__).parent / "guest_pool.py").read_text()
    for name in ("POOLED_READY", "MAX_PLAN_BYTES"):
        line = next(x for x in src.splitlines() if x.startswith(f"{name} = "))
        assert eval(line.split("=", 1)[1]) == getattr(microvm, name)  # noqa: S307 - ours


def test_a_pooled_guests_ahead_is_what_every_claims_plan_carries() -> None:
    """What a pooled guest puts in force before its claim (backends.microvm._ahead, from
    the settings and the pool's shape) equals that part of any task's plan of the shape,
    whatever the task's command, stdin, session or environment."""
    from types import SimpleNamespace

    from stockade.launcher import SandboxSpec
    from stockade.launcher.backends import microvm as backend
    from stockade.launcher.settings import LauncherSettings
    from stockade.policy.model import Limits

    ctx = SimpleNamespace(
        settings=LauncherSettings(), limits=Limits(cpus=0.5, memory=64 * MIB, disk=8 * MIB,
                                                   pids=64, ttl=30),
        addresses=SimpleNamespace(guest_ip="10.213.0.2", host_ip="10.213.0.1", prefixlen=30,
                                  guest_mac="02:00:0a:d5:00:02"),
        env={"PATH": "/usr/bin", "LD_PRELOAD": "x"}, congestion_control="bbr",
        seccomp=lambda: b"\0" * 8, selftest=None)
    for spec in (SandboxSpec("p", ["bash", "-c", "x"], stdin=b"in"),
                 SandboxSpec("p", ["true"], session=True)):
        plan = backend._plan(spec, ctx, restored=True)  # type: ignore[arg-type]
        assert microvm.ahead(plan) == backend._ahead(ctx)  # type: ignore[arg-type]
    assert backend._ahead(ctx)["cpu_max"] == "50000 100000"  # type: ignore[arg-type]


def test_a_pooled_guests_warm_up_locale_is_its_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The locale a pool's warm-up runs under: the host's allowlisted LANG and LC_*, which
    every task gets (environment.sandbox_env); nothing else of the host's environment."""
    from stockade.launcher.backends import microvm as backend
    from stockade.launcher.settings import LauncherSettings

    for k in ("LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("LC_CTYPE", "en_US.UTF-8")  # not allowlisted: no task gets it
    monkeypatch.setenv("TZ", "UTC")
    s = LauncherSettings()
    assert "LC_CTYPE" not in s.env_allowlist and "TZ" in s.env_allowlist
    assert backend._task_locale(s) == {"LANG": "C.UTF-8"}
    monkeypatch.delenv("LANG")
    assert backend._task_locale(s) == {}


def test_a_pooled_guests_filter_is_a_default_profiles_own() -> None:
    """The filter a pooled guest's command child loads before its claim is byte for byte
    what a claim of a profile without relaxations carries (the guest hands that child only
    such a plan), and not what a profile relaxing ptrace carries (that claim's command gets
    a fresh child, which loads the claim's filter)."""
    import types

    from stockade.launcher.backends import pool_seccomp_program, seccomp_program
    from stockade.policy.model import SyscallRelaxation

    python = "/usr/bin/python3"  # the init's interpreter, with python3-seccomp
    plain = types.SimpleNamespace(name="p", syscalls=None)
    debug = types.SimpleNamespace(
        name="d", syscalls=SyscallRelaxation(frozenset({"ptrace"}), "debugger"))
    pooled = pool_seccomp_program(python)
    assert pooled == seccomp_program(python, plain)
    assert pooled != seccomp_program(python, debug)


@pytest.mark.parametrize(("text", "version"), [
    (b"QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\n", (7, 2)),
    (b"QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)\nCopyright", (10, 0)),
    (b"QEMU emulator version 8.1.0\n", (8, 1)),
    (b"not a qemu\n", None),
    (b"", None),
])
def test_qemu_version_parsed(text: bytes, version: tuple[int, int] | None) -> None:
    assert vmimage.parse_qemu_version(text) == version


def test_run_with_asks_the_binary_and_again_once_it_changes(tmp_path: Path) -> None:
    qemu = tmp_path / "qemu"
    qemu.write_text("#!/bin/sh\necho 'QEMU emulator version 7.2.0'\n")
    qemu.chmod(0o755)
    assert vmimage.run_with(str(qemu)) is False
    qemu.write_text("#!/bin/sh\necho 'QEMU emulator version 10.0.2 (Debian)'\n")
    assert vmimage.run_with(str(qemu)) is True  # a replaced binary is asked again
    qemu.write_text("#!/bin/sh\nexit 1\n")
    assert vmimage.run_with(str(qemu)) is False  # unknown: the old spelling
    assert vmimage.run_with(str(tmp_path / "missing")) is False
