"""The sandbox's init plan: a pure function turns what the launcher decided (binds, scratch,
inputs, ids) into a JSON list of operations that `sandbox_init.py` performs as pid 1 inside
the new mount/pid/ipc/uts namespaces (already in the sandbox's netns).

Filesystem it builds (under a fresh tmpfs that becomes `/` through pivot_root):
- read-only binds of the host's system directories (`ro_binds`; symlinks copied as symlinks)
- a minimal `/etc` on the root tmpfs: the launcher's generated files (`etc_content`) and
  read-only binds of allowlisted host /etc entries (`etc_allowlist`); only when `ro_binds`
  lists `/etc` itself is the host's whole /etc bound, with resolv.conf, hosts, hostname
  bound over it (the host's own copies must exist: a read-only /etc cannot grow files)
- `/scratch` (the size-capped tmpfs, the only writable place; `/tmp` and `HOME` live in it)
- inputs bound read-only at their guest paths
- a new `/proc` (pid namespace), a minimal read-only `/dev`, a small `/dev/shm`
then the root tmpfs is remounted read-only. The values are data, never parsed as shell.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
SCRATCH = "/scratch"
TMP = "/tmp"  # noqa: S108 - a path inside the sandbox
# what an input may not be mounted at or under, in either backend: the sandbox's own mounts
# (scratch, /tmp, /proc, /dev, /sys), the netns init's old root, the microVM guest's init
# (/init, /sbx: its busybox, plan, ports, cgroup) and everything the init relies on while it
# is still root: the system directories (the Python that runs it, the dynamic
# loader and the libraries are there) and /etc (ld.so.preload, ld.so.cache). `ro_binds`
# entries are added by the launcher (`check_input_target(..., extra=)`). In the microVM an
# input there would be mounted before the guest's root init execs its Python
# (a forged plan on /sbx/cfg, a fake python3 on /usr/bin: guest root). In the netns backend
# the init has already started and drops privileges before it execs anything, so such an
# input would only break the command's own tools; it is refused there too (one rule, one
# error, and no input can hide the generated /etc files).
RESERVED = (SCRATCH, TMP, "/proc", "/dev", "/sys", "/.oldroot", "/init", "/sbx", "/etc",
            "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
OLDROOT = ".oldroot"

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8

# files of the sandbox's /etc written by the launcher per sandbox (never the host's)
GENERATED_ETC = ("resolv.conf", "hosts", "hostname", "passwd", "group", "nsswitch.conf")
# the subset bound over a host /etc when `ro_binds` lists /etc (the behaviour before the
# minimal /etc; passwd and group then stay the host's)
HOST_ETC_OVERLAY = ("resolv.conf", "hosts", "hostname")
NOBODY, NOGROUP = 65534, 65534


@dataclass(frozen=True, slots=True)
class Bind:
    source: str  # host path
    target: str  # absolute path inside the sandbox
    is_dir: bool = True
    symlink_to: str | None = None  # host path is a symlink with this target: copy it


@dataclass(frozen=True, slots=True)
class InitPlan:
    root: str  # host directory that becomes the mount point of the new root
    scratch: str  # host path of the scratch tmpfs
    etc_dir: str  # host directory holding the generated /etc files of the sandbox
    uid: int
    gid: int
    hostname: str = "sandbox"
    system: tuple[Bind, ...] = ()
    inputs: tuple[Bind, ...] = ()
    shm_size: int = 16 * 2**20
    etc_files: tuple[str, ...] = GENERATED_ETC  # names in etc_dir bound at /etc/<name>
    etc: tuple[Bind, ...] = ()  # allowlisted host /etc entries (targets under /etc)
    host_etc: bool = False  # `ro_binds` binds the host's /etc: only overlay etc_files on it
    cgroup_procs: tuple[str, ...] = ()  # joined first, before anything else runs
    rlimits: tuple[tuple[str, int], ...] = ()  # ("NOFILE", 4096): RLIMIT_<name>, soft = hard
    congestion_control: str | None = None  # the netns' TCP default; None: left as it is
    # (etc_dir file name, path under /etc) bound read-only over an allowlisted host file
    # that exists there (the trust bundle over ssl/certs/ca-certificates.crt)
    etc_over: tuple[tuple[str, str], ...] = ()


def _guest(path: str) -> str:
    if (not path.startswith("/") or "\0" in path or "/../" in path + "/"
            or "/./" in path + "/" or path.rstrip("/") == ""):
        raise ValueError(f"guest path must be absolute and normalised: {path!r}")
    return path.rstrip("/")


def check_etc_entry(entry: str) -> str:
    """An `etc_allowlist` entry: a path relative to /etc (glob characters allowed), never a
    generated file (those are the launcher's, per sandbox) nor /etc itself."""
    p = entry.rstrip("/")
    if entry.startswith("/") or not p or "\0" in p or any(
            seg in ("", ".", "..") for seg in p.split("/")):
        raise ValueError(f"etc_allowlist entry must be a normalised path relative to /etc: "
                         f"{entry!r}")
    if p.split("/")[0] in GENERATED_ETC:
        raise ValueError(f"etc_allowlist entry {entry!r} names a file the launcher generates")
    return p


def etc_content(nameserver: str, hostname: str, uid: int, gid: int) -> dict[str, str]:
    """The generated /etc files. passwd/group hold only root, nobody/nogroup and the sandbox
    user/group (named `sandbox` unless they are nobody/nogroup), so `id`, `getent`, `whoami`
    and tools calling getpwuid() work without showing the host's accounts."""
    home = "/scratch/home"  # = HOME of the command; getpwuid() users agree with $HOME
    users = [("root", 0, 0, "root", "/root", "/bin/sh")]
    if uid == NOBODY:
        users.append(("nobody", NOBODY, gid, "nobody", home, "/bin/sh"))
    else:
        users += [("sandbox", uid, gid, "sandbox", home, "/bin/sh"),
                  ("nobody", NOBODY, NOGROUP, "nobody", "/nonexistent", "/usr/sbin/nologin")]
    groups = [("root", 0)]
    if gid != NOGROUP:
        groups.append(("sandbox", gid))
    groups.append(("nogroup", NOGROUP))
    return {
        "resolv.conf": f"nameserver {nameserver}\noptions timeout:2\n",
        "hosts": f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n",
        "hostname": f"{hostname}\n",
        "passwd": "".join(f"{n}:x:{u}:{g}:{gecos}:{h}:{sh}\n" for n, u, g, gecos, h, sh in users),
        "group": "".join(f"{n}:x:{g}:\n" for n, g in groups),
        # files only (no NIS/LDAP/sss/systemd modules that would reach out); names: the
        # sandbox's hosts file, then DNS (the gateway's DNS firewall)
        "nsswitch.conf": ("passwd: files\ngroup: files\nshadow: files\ngshadow: files\n"
                          "hosts: files dns\nnetworks: files\nprotocols: files\n"
                          "services: files\nethers: files\nrpc: files\nnetgroup: files\n"),
    }


def check_input_target(path: str, extra: Iterable[str] = ()) -> str:
    """Inputs may not shadow the sandbox's own mounts nor anything its init relies on
    (`RESERVED`, plus `extra`: the configured `ro_binds`)."""
    p = _guest(path)
    for r in (*RESERVED, *(x.rstrip("/") for x in extra)):
        if r and (p == r or p.startswith(r + "/")):
            raise ValueError(f"input target {path!r} is inside reserved {r}, which the "
                             f"sandbox's init relies on (input targets may not be at or "
                             f"under {', '.join(RESERVED)} or a ro_binds entry)")
    return p


def _bind(b: Bind, r: str, target: str) -> list[list[Any]]:
    t = r + target
    if b.symlink_to is not None:
        return [["symlink", b.symlink_to, t]]
    return [["mkdir", t, 0o755] if b.is_dir else ["touch", t],
            ["bind", b.source, t, True, False]]


def _prelude(plan: InitPlan, r: str) -> list[list[Any]]:
    """The init's own setup in the sandbox's namespaces, then the new root's tmpfs."""
    return [
        ["cgroup", list(plan.cgroup_procs)],
        # best effort (some hosts forbid lowering it): the OOM killer should take the command,
        # not pid 1 (which reports the command's status);
        # the command goes back to 0 before it starts
        ["write", "/proc/self/oom_score_adj", "-1000", True],
        ["mount", "stockade-root", r, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755"],
    ]


def _sysctls(plan: InitPlan, p: str) -> list[list[Any]]:
    """The sandbox's sysctls, through its own fresh procfs at `p`: the /proc/sys the init
    inherits is read-only in a container (the Helm chart's launcher), a new one is not.
    Its net files reflect the init's netns, its hostname the init's UTS namespace."""
    return [
        # IPv6 off before anything of the sandbox runs
        ["write", p + "/sys/net/ipv6/conf/all/disable_ipv6", "1", True],
        ["write", p + "/sys/net/ipv6/conf/default/disable_ipv6", "1", True],
        # unprivileged ICMP sockets: a ping gets a legible "prohibited" (nft still rejects it)
        ["write", p + "/sys/net/ipv4/ping_group_range", "0 2147483647", True],
        # best effort: an algorithm the kernel lacks leaves the host's default
        *([["write", p + "/sys/net/ipv4/tcp_congestion_control", plan.congestion_control,
            True]] if plan.congestion_control else []),
        ["write", p + "/sys/kernel/hostname", plan.hostname, False],
    ]


def _etc(plan: InitPlan, r: str) -> list[list[Any]]:
    """The sandbox's /etc: the generated files over the host's whole /etc, or a directory
    of them with the allowlisted host entries and the trust bundle over its default."""
    if plan.host_etc:
        # the host /etc is read-only: a file it lacks cannot be created, so it is skipped
        return [["bind", f"{plan.etc_dir}/{name}", f"{r}/etc/{name}", True, True]
                for name in plan.etc_files]
    # /etc is a directory of the root tmpfs (read-only once the root is remounted)
    ops: list[list[Any]] = [["mkdir", r + "/etc", 0o755]]
    for name in plan.etc_files:
        ops += [["touch", f"{r}/etc/{name}"],
                ["bind", f"{plan.etc_dir}/{name}", f"{r}/etc/{name}", True, False]]
    generated = {"/etc/" + n for n in plan.etc_files}
    for b in plan.etc:
        t = _guest(b.target)
        if not t.startswith("/etc/"):
            raise ValueError(f"etc entry outside /etc: {b.target!r}")
        # a glob such as host* must not shadow a generated file
        if not any(t == g or t.startswith(g + "/") for g in generated):
            ops += _bind(b, r, t)
    for name, rel in plan.etc_over:
        t = _guest("/etc/" + rel)
        # only over a file the allowlist brought in (the read-only bind cannot grow one)
        ops.append(["bind", f"{plan.etc_dir}/{name}", r + t, True, True])
    return ops


def _scratch(plan: InitPlan, r: str) -> list[list[Any]]:
    return [
        ["mkdir", r + SCRATCH, 0o755],
        ["mkdir", r + TMP, 0o755],
        ["bind", plan.scratch, r + SCRATCH, False, False],
        # the sandbox's /tmp is a directory of the scratch tmpfs (size-capped with it)
        ["bind", plan.scratch + TMP, r + TMP, False, False],
    ]


def _inputs(plan: InitPlan, r: str) -> list[list[Any]]:
    ops: list[list[Any]] = []
    for b in plan.inputs:
        t = check_input_target(b.target)
        # the mount point must resolve to itself, checked before it is created: a symlink
        # inside an earlier input must not lead the init (root, still in the host's tree)
        # to create directories or files elsewhere, nor the bind onto the host's /dev
        ops += [["confined", r + t, r], *_bind(b, r, t)]
    return ops


def _proc_dev(plan: InitPlan, r: str) -> list[list[Any]]:
    """/proc and a minimal /dev with its own /dev/shm."""
    d = r + "/dev"
    ops: list[list[Any]] = [
        ["mkdir", r + "/proc", 0o555],
        ["mount", "proc", r + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None],
        *_sysctls(plan, r + "/proc"),
        ["mkdir", d, 0o755],
        ["mount", "stockade-dev", d, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755"],
    ]
    for dev in DEVICES:
        ops += [["touch", f"{d}/{dev}"], ["bind", f"/dev/{dev}", f"{d}/{dev}", False, False]]
    return [
        *ops,
        ["symlink", "/proc/self/fd", d + "/fd"],
        ["symlink", "/proc/self/fd/0", d + "/stdin"],
        ["symlink", "/proc/self/fd/1", d + "/stdout"],
        ["symlink", "/proc/self/fd/2", d + "/stderr"],
        ["mkdir", d + "/shm", 0o1777],
        ["mount", "stockade-shm", d + "/shm", "tmpfs", MS_NOSUID | MS_NODEV,
         f"size={plan.shm_size},mode=1777"],
        ["remount_ro", d, MS_NOSUID | MS_NOEXEC],
    ]


def _pivot(r: str) -> list[list[Any]]:
    """The switch into the new root: the host's tree is out of reach from here on."""
    return [
        ["mkdir", f"{r}/{OLDROOT}", 0o700],
        ["pivot", r, OLDROOT],
        ["remount_ro", "/", MS_NOSUID | MS_NODEV],
        ["chdir", SCRATCH],
    ]


def _setup(plan: InitPlan, r: str) -> list[list[Any]]:
    """Everything before the inputs: the same for every task of a resource shape."""
    ops = _prelude(plan, r)
    for b in plan.system:
        ops += _bind(b, r, _guest(b.target))
    return ops + _etc(plan, r) + _scratch(plan, r) + _proc_dev(plan, r)


def build(plan: InitPlan) -> dict[str, Any]:
    r = plan.root.rstrip("/")
    ops = _setup(plan, r) + claim_ops(plan)
    return {"ops": ops, "uid": plan.uid, "gid": plan.gid, "rlimits": dict(plan.rlimits)}


def build_pooled(plan: InitPlan) -> dict[str, Any]:
    """A warm-pool sandbox's init plan: the operations no task decides (`plan.inputs` is
    not used); the init then waits for its claim (`claim_ops` and the command)."""
    r = plan.root.rstrip("/")
    return {"ops": _setup(plan, r), "uid": plan.uid, "gid": plan.gid,
            "rlimits": dict(plan.rlimits)}


def claim_ops(plan: InitPlan) -> list[list[Any]]:
    """What a task brings to a sandbox whose setup is done: its inputs, bound read-only
    while the host's tree is still reachable, then the pivot into the new root."""
    r = plan.root.rstrip("/")
    return _inputs(plan, r) + _pivot(r)


def exec_plan(plan: InitPlan, init_pid: int) -> dict[str, Any]:
    """The plan of a session's exec server (`sandbox_init.py` with `join`): the sandbox's
    cgroups and its init's namespaces to join, then for every exec the same uid, gid and
    rlimits as the first command (`build`)."""
    return {"join": {"pid": init_pid, "cgroup_procs": list(plan.cgroup_procs)},
            "uid": plan.uid, "gid": plan.gid, "rlimits": dict(plan.rlimits)}
