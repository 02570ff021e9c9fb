"""The QEMU microVM backend's pure core: the guest's layout, plan and mount table, the kernel
command line and the QEMU argv. `backends/microvm.py` does the I/O (netns, tap, cgroups, processes).

One sandbox = the netns backend's network pieces (netns, veth, nft elements, registrations),
but the netns holds no address: a tap there is joined to the netns end of the veth by two
tc mirred redirects, so the guest's eth0 (the sandbox address and MAC) is what the host-side
veth and its nft rules see. QEMU runs in that netns and in the sandbox's cgroups; the guest
sees the host's system directories, its /etc and its scratch through 9p shares (the same
scratch tmpfs as the netns backend), and talks back through virtio-serial ports: stdout,
stderr and a status line. Nothing of the task reaches the kernel command line: argv, env
and addresses travel in files of a read-only config share.
"""

from __future__ import annotations

import marshal
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from . import cgroups
from .initscript import RESERVED, SCRATCH, TMP, Bind

Accel = Literal["kvm", "tcg"]
CFG_TAG = "stockade-cfg"
# vm-images/init and guest_init.py use these names: keep them in step
PORT_NAMES = ("stdout", "stderr", "status")
# the guest agent's port (sessions): a number the guest finds it by (guest_init.AGENT_NR),
# after the three above
AGENT_PORT, AGENT_PORT_NR = "agent", 4
TAP = "tap0"
MIB = 2**20
# a guest path ends up in the mount table as the rest of a line: no newline, no NUL
_SAFE_TAG = re.compile(r"^[a-z][a-z0-9-]{0,30}\Z")


@dataclass(frozen=True, slots=True)
class Share:
    """A host directory the guest mounts over 9p (one virtio-9p-device)."""

    tag: str
    host: str
    guest: str
    readonly: bool = True


@dataclass(frozen=True, slots=True)
class Layout:
    """The guest's filesystem, in mount order."""

    shares: tuple[Share, ...] = ()
    # (kind, a, guest path): ("link", target, path), ("bind", src, path) read-only,
    # ("bindrw", src, path), ("tmpfs", size, path); after every share is mounted
    extra: tuple[tuple[str, str, str], ...] = ()
    # the inputs, mounted by guest_init.py only once it has read the plan and opened what
    # it execs as root (vm-images/init mounts `shares` and `extra` before it starts it):
    # directories over 9p, then the staged files bound read-only (source, guest path)
    input_shares: tuple[Share, ...] = ()
    input_binds: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class VmSpec:
    qemu: str
    accel: Accel
    kernel: str
    initrd: str
    memory_mib: int
    cpus: int
    mac: str
    cfg_dir: str  # host directory shared read-only as CFG_TAG
    layout: Layout
    # /proc/self/fd/N paths (pipes the launcher reads) of the console and the three ports
    console: str
    ports: tuple[str, str, str]
    agent_fd: int | None = None  # a connected socket: the guest agent's port
    # snapshot starts (vmsnapshot.py): a template boot (its init stops before any share is
    # mounted, its QMP monitor on `qmp_fd`), or a guest restored from one (`incoming_fd`:
    # the saved state); both have the agent port
    template: bool = False
    qmp_fd: int | None = None
    incoming_fd: int | None = None
    tsc_khz: int | None = None  # TCG: the host's TSC rate (the guest cannot calibrate it)
    tb_size_mib: int = 256  # TCG translation cache (QEMU's default would be 1 GiB)
    runas: tuple[int, int] | None = None  # QEMU drops to this uid:gid once set up
    # QEMU 8.1+ spells the drop `-run-with user=` (10.0 removed `-runas`): vmimage.run_with
    run_with: bool = False
    bios: str | None = None  # `-bios` (vmimage.microvm_bios); None: QEMU's default
    seccomp: bool = True  # QEMU's -sandbox filter
    extra_cmdline: tuple[str, ...] = field(default_factory=tuple)


def guest_layout(*, system: Sequence[Bind], etc_dir: str, host_etc: bool,
                 host_etc_overlay: Sequence[str], scratch: str, inputs: Sequence[Bind],
                 staged_dir: str, shm_size: int) -> tuple[Layout, list[tuple[str, str]]]:
    """The guest's filesystem, and the (host file, staged path) copies it needs.

    `system` (`ro_binds`): directories over 9p read-only, symlinks recreated; /etc: the
    sandbox's generated files plus the allowlist copies (`etc_dir`), or with `host_etc` the
    host's /etc with the generated `host_etc_overlay` files bound over it; /scratch (the
    scratch tmpfs) read-write, /tmp in it; inputs read-only: directories over 9p, files
    copied into one staged share (9p shares directories) and bound at their targets;
    /dev/shm a tmpfs of `shm_size`.
    """
    shares: list[Share] = []
    extra: list[tuple[str, str, str]] = []
    copies: list[tuple[str, str]] = []
    for i, b in enumerate(system):
        if b.symlink_to is not None:
            extra.append(("link", b.symlink_to, b.target))
        elif b.is_dir:
            shares.append(Share(f"sys{i}", b.source, b.target))
    if host_etc:
        shares += [Share("etc", "/etc", "/etc"), Share("etc-gen", etc_dir, "/sbx/etc")]
        extra += [("bind", f"/sbx/etc/{n}", f"/etc/{n}") for n in host_etc_overlay]
    else:
        shares.append(Share("etc", etc_dir, "/etc"))
    shares.append(Share("scratch", scratch, SCRATCH, readonly=False))
    extra.append(("bindrw", SCRATCH + TMP, TMP))
    input_shares: list[Share] = []
    input_binds: list[tuple[str, str]] = []
    for i, b in enumerate(inputs):
        if b.is_dir:
            input_shares.append(Share(f"in{i}", b.source, b.target))
        else:
            copies.append((b.source, f"{staged_dir}/{i}"))
            input_binds.append((f"/sbx/in/{i}", b.target))
    if copies:  # the staged copies' share itself lives in the init's /sbx
        shares.append(Share("inputs", staged_dir, "/sbx/in"))
    extra.append(("tmpfs", str(shm_size), "/dev/shm"))  # noqa: S108 - in the guest
    return Layout(tuple(shares), tuple(extra), tuple(input_shares), tuple(input_binds)), copies


def check_tag(tag: str) -> str:
    if not _SAFE_TAG.match(tag):
        raise ValueError(f"bad 9p tag {tag!r}")
    return tag


def check_guest_path(path: str) -> str:
    if (not path.startswith("/") or any(c in path for c in "\n\r\0")
            or "/../" in path + "/" or "/./" in path + "/" or path.rstrip("/") == ""):
        raise ValueError(f"guest path must be absolute and normalised: {path!r}")
    return path.rstrip("/")


def guest_memory_mib(profile_memory: int, guest_kernel_mib: int) -> int:
    """Guest RAM: the profile's memory (the command's cgroup inside the guest gets exactly
    that) plus the guest kernel's own share."""
    return math.ceil(profile_memory / MIB) + guest_kernel_mib


def host_memory_limit(profile_memory: int, profile_disk: int, guest_kernel_mib: int,
                      vmm_overhead_mib: int, tb_mib: int = 0) -> int:
    """The sandbox cgroup's memory limit on the host: guest RAM, QEMU's own memory, its TCG
    translation cache (`tb_mib`, 0 under KVM), and the scratch tmpfs (its pages are charged
    to QEMU, who writes them for the guest)."""
    return ((guest_memory_mib(profile_memory, guest_kernel_mib) + vmm_overhead_mib + tb_mib)
            * MIB + profile_disk)


def vcpus(profile_cpus: float) -> int:
    return max(1, math.ceil(profile_cpus))


def kernel_cmdline(accel: Accel, tsc_khz: int | None, extra: tuple[str, ...] = ()) -> str:
    """No task data here: the command line is visible to the guest (/proc/cmdline)."""
    args = ["console=ttyS0", "quiet", "loglevel=1", "panic=-1", "reboot=t", "ipv6.disable=1",
            "8250.nr_uarts=1", "random.trust_cpu=on"]
    if accel == "tcg" and tsc_khz:
        # under TCG the PIT calibration of the TSC fails now and then, and the kernel then
        # hangs in its delay loop calibration; TCG's guest TSC is the host's
        args += [f"tsc_early_khz={tsc_khz}", "tsc=reliable"]
    return " ".join([*args, *extra])


def mount_table(layout: Layout) -> str:
    """vm-images/init's mount table: `9p TAG ro|rw PATH`, `link TARGET PATH`, `bind SRC PATH`,
    `bindrw SRC PATH`, `tmpfs SIZE PATH`; the guest path is last (it may hold spaces)."""
    lines = []
    for s in layout.shares:
        lines.append(f"9p {check_tag(s.tag)} {'ro' if s.readonly else 'rw'} "
                     f"{check_guest_path(s.guest)}")
    for kind, a, path in layout.extra:
        if kind not in ("link", "bind", "bindrw", "tmpfs"):
            raise ValueError(f"unknown mount kind {kind!r}")
        if not a or any(c in a for c in " \t\n\r\0"):
            raise ValueError(f"bad {kind} source {a!r}")
        lines.append(f"{kind} {a} {check_guest_path(path)}")
    return "".join(line + "\n" for line in lines)


def input_table(layout: Layout) -> str:
    """guest_init.py's input table: `9p TAG PATH` (read-only directory shares), then
    `bind SRC PATH` (staged files, read-only); the guest path is last."""
    lines = [f"9p {check_tag(s.tag)} {check_guest_path(s.guest)}" for s in layout.input_shares]
    for src, path in layout.input_binds:
        if not src or any(c in src for c in " \t\n\r\0"):
            raise ValueError(f"bad bind source {src!r}")
        lines.append(f"bind {src} {check_guest_path(path)}")
    return "".join(line + "\n" for line in lines)


def guest_plan(*, argv: list[str], env: dict[str, str], uid: int, gid: int,
               rlimits: dict[str, int], guest_ip: str, host_ip: str, prefixlen: int,
               memory: int, pids: int, pids_fail_kill: int, stdin: bool, cpus: float,
               hostname: str = "sandbox", cwd: str = "/scratch",
               congestion_control: str | None = None,
               reserved: Sequence[str] = RESERVED,
               seccomp: bytes = b"",
               session_modules: Sequence[tuple[str, str]] | None = None,
               fresh: dict[str, Any] | None = None, probe_first: bool = False) -> dict[str, Any]:
    """guest_init.py's plan: plain data (dict, list, str, int, bool, bytes, None).
    `reserved`: the paths no input may be mounted at or under (the guest checks its input
    table again). `cpus`: the profile's CPU limit, the `cpu.max` of the command's cgroup in
    the guest (the host's cgroup of QEMU holds the VM's vCPUs). `seccomp`: the container
    tier's BPF program (`seccomp_bpf.py`), loaded in the guest right before the exec; the
    guest refuses to start the command without one.
    `session_modules` ((name, source) of vmchannel and guest_agent): a session guest, whose
    init serves execs through its agent instead of running `argv`; with `probe_first` it
    serves them only until the launcher closes the agent's port (the fence self-test's
    probes run through it), then runs `argv` as any guest does. `fresh`: the identity
    of a guest restored from a snapshot (`fresh_identity`), set before its network is."""
    if not argv and session_modules is None:
        raise ValueError("empty command")
    if uid == 0 or gid == 0:
        raise ValueError("the command never runs as root")
    return {
        "argv": list(argv), "env": dict(env), "uid": uid, "gid": gid, "rlimits": rlimits,
        "cwd": cwd, "hostname": hostname, "stdin": stdin, "memory": memory, "pids": pids,
        "cpu_max": cgroups.cpu_max(cpus), "pids_fail_kill": pids_fail_kill,
        "congestion_control": congestion_control, "seccomp": seccomp,
        "reserved": [r.rstrip("/") for r in reserved if r.rstrip("/")],
        "net": {"ip": guest_ip, "prefixlen": prefixlen, "gateway": host_ip},
        "session": session_modules is not None and not probe_first,
        "probe_first": probe_first and session_modules is not None,
        "modules": list(session_modules or ()),
        "fresh": fresh,
    }


def fresh_identity(mac: str, seed: bytes, clock: float) -> dict[str, Any]:
    """What a restored guest must not keep of its snapshot: the MAC (the device's is the
    template's), the kernel's random state (reseeded from `seed`) and the wall clock."""
    if len(seed) < 32:
        raise ValueError("an entropy seed of at least 32 bytes")
    return {"mac": mac, "seed": bytes(seed), "clock": float(clock)}


# a pooled guest (guest_pool.py `claimed`) says this on its agent port once everything no
# task decides is done, then reads its plan there: a 4-byte big-endian length, the plan
POOLED_READY = b"stockade-pooled-ready\n"
MAX_PLAN_BYTES = 16 * MIB


# what a pooled guest sets up before its claim (the command's user and rlimits, its
# cgroup's limits, the sysctls): the launcher's settings and the pool's shape, the same
# for every task the pool serves; the guest refuses a claim whose plan differs in one
AHEAD_KEYS = ("uid", "gid", "rlimits", "memory", "pids", "cpu_max", "hostname",
              "congestion_control")


def ahead(plan: dict[str, Any]) -> dict[str, Any]:
    """The part of a task's plan (`guest_plan`) a pooled guest puts in force ahead."""
    return {k: plan[k] for k in AHEAD_KEYS}


def pooled_plan(session_modules: Sequence[tuple[str, str]], guest_ip: str, host_ip: str,
                prefixlen: int, fresh: dict[str, Any], ahead: dict[str, Any],
                seccomp: bytes, warmup: Sequence[Sequence[str]] = (),
                warmup_locale: dict[str, str] | None = None) -> dict[str, Any]:
    """The config share's plan of a pooled guest: no task, only what every task's guest
    loads (the agent's modules), its slot's network and a fresh identity (`fresh_identity`:
    the claim's plan brings another seed and the clock, the same MAC and network), what
    every task of its pool runs under (`ahead`: put in force before the claim), the
    seccomp filter of a profile without relaxations (`seccomp`: the command's child loads
    it while it waits; a claim whose filter is other bytes gets a fresh child, which
    loads the claim's), the commands it runs once before (`warmup`:
    microvm.pool_warmup) under the locale its tasks get (`warmup_locale`: LANG and LC_*
    only), and the mark that its real plan comes on the agent port."""
    if set(ahead) != set(AHEAD_KEYS) or ahead["uid"] == 0 or ahead["gid"] == 0:
        raise ValueError("a pooled guest's command never runs as root")
    if not seccomp or len(seccomp) % 8:
        raise ValueError("a pooled guest's child loads a seccomp filter: none given")
    return {"pooled": True, "modules": list(session_modules), "fresh": fresh,
            "net": {"ip": guest_ip, "prefixlen": prefixlen, "gateway": host_ip},
            "ahead": dict(ahead), "seccomp": bytes(seccomp),
            "warmup": [list(a) for a in warmup],
            "warmup_locale": {k: v for k, v in (warmup_locale or {}).items()
                              if k == "LANG" or k.startswith("LC_")}}


def plan_frame(plan: dict[str, Any]) -> bytes:
    """A claimed pooled guest's plan as sent on its agent port."""
    blob = encode_plan(plan)
    if len(blob) > MAX_PLAN_BYTES:
        raise ValueError(f"the guest's plan is {len(blob)} bytes, over {MAX_PLAN_BYTES}")
    return len(blob).to_bytes(4, "big") + blob


def encode_plan(plan: dict[str, Any]) -> bytes:
    """marshal (a builtin the guest's Python reads without importing anything; format 4 is
    what every Python 3.4+ reads), never a format parsed as shell."""
    return marshal.dumps(plan, 4)


def bios_argv(bios: str | None) -> list[str]:
    """`-bios` naming the firmware, nothing for QEMU's default."""
    return ["-bios", bios] if bios else []


def qemu_argv(v: VmSpec) -> list[str]:
    # no legacy PIT and PIC (the guest's timers: TSC (its rate on the command line under
    # TCG) and the local APIC; interrupts: the I/O APIC), no option ROMs; the RTC stays: it
    # is the guest's only wall clock under TCG (no kvmclock), and TLS needs the date
    machine = "microvm,pit=off,pic=off,x-option-roms=off"
    argv = [v.qemu, "-M", machine, *bios_argv(v.bios), "-nodefaults",
            "-no-user-config", "-nographic", "-no-reboot"]
    if v.accel == "kvm":
        argv += ["-accel", "kvm", "-cpu", "host"]
    else:
        argv += ["-accel", f"tcg,tb-size={v.tb_size_mib}", "-cpu", "max"]
    argv += ["-smp", str(v.cpus), "-m", f"{v.memory_mib}M",
             "-kernel", v.kernel, "-initrd", v.initrd,
             "-append", kernel_cmdline(v.accel, v.tsc_khz, (
                 *v.extra_cmdline, *(["stockade.template"] if v.template else []))),
             "-chardev", f"file,id=con,path={v.console}", "-serial", "chardev:con",
             # no virtio-net header: the guest gets no offloads (GSO, checksum) to hand the
             # host's kernel; plain frames only
             "-netdev", f"tap,id=net0,ifname={TAP},script=no,downscript=no,vhost=off,"
                        "vnet_hdr=off",
             "-device", f"virtio-net-device,netdev=net0,mac={v.mac}",
             "-device", f"virtio-serial-device,max_ports={AGENT_PORT_NR + 1}"]
    for nr, (name, path) in enumerate(zip(PORT_NAMES, v.ports, strict=True), start=1):
        argv += ["-chardev", f"file,id={name},path={path}",
                 "-device", f"virtserialport,chardev={name},name={name},nr={nr}"]
    if v.agent_fd is not None:
        argv += ["-chardev", f"socket,id={AGENT_PORT},fd={v.agent_fd}",
                 "-device", f"virtserialport,chardev={AGENT_PORT},name={AGENT_PORT},"
                            f"nr={AGENT_PORT_NR}"]
    shares = [Share(CFG_TAG, v.cfg_dir, "/sbx/cfg"), *v.layout.shares, *v.layout.input_shares]
    for i, s in enumerate(shares):
        _no_comma(s.host)
        argv += ["-fsdev", f"local,id=fs{i},path={s.host},security_model=none,"
                           f"readonly={'on' if s.readonly else 'off'},multidevs=remap",
                 "-device", f"virtio-9p-device,fsdev=fs{i},mount_tag={check_tag(s.tag)}"]
    if v.seccomp:
        # elevateprivileges stays allowed: QEMU's filter is installed before -runas (or
        # -run-with user=) drops root (which needs setuid); after it nothing is left to gain
        argv += ["-sandbox", "on,obsolete=deny,spawn=deny,resourcecontrol=deny"]
    if v.runas is not None:
        user = f"{v.runas[0]}:{v.runas[1]}"
        argv += ["-run-with", f"user={user}"] if v.run_with else ["-runas", user]
    if v.qmp_fd is not None:
        argv += ["-chardev", f"socket,id=qmp,fd={v.qmp_fd}", "-mon", "chardev=qmp,mode=control"]
    if v.incoming_fd is not None:
        argv += ["-incoming", f"fd:{v.incoming_fd}"]
    return argv


def _no_comma(path: str) -> None:
    # QEMU's option syntax splits on commas (",," escapes); refuse rather than escape
    if "," in path or "\n" in path:
        raise ValueError(f"host path not usable in a QEMU option: {path!r}")


def parse_status(text: str) -> tuple[int, int, int] | None:
    """guest_init's status line: (exit status, OOM kills, pids limit hits), or None."""
    parts = text.split()
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    rc, ooms, pids = (int(p) for p in parts)
    return (rc, ooms, pids) if rc <= 255 else None

