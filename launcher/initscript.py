"""The sandbox's init: a POSIX sh script, built here by a pure function, that runs as root
inside the new mount/pid/ipc/uts namespaces (already in the sandbox's netns and cgroups)
and then becomes the command as an unprivileged user with no capabilities.

Hand-written because it is a short fixed sequence of mount(8) calls; a container runtime
would add an image format and a daemon that the netns floor does not need. Every value
is passed through `shlex.quote`, so no path or argument is ever parsed as shell.

Filesystem it builds (under a fresh tmpfs that becomes `/` through pivot_root):
- read-only binds of the host's system directories (`ro_binds`; symlinks copied as symlinks)
- `/etc/resolv.conf`, `/etc/hosts`, `/etc/hostname` replaced by the launcher's files
- `/scratch` (the size-capped tmpfs, the only writable place; `/tmp` and `HOME` live in it)
- inputs bound read-only at their guest paths
- a new `/proc` (pid namespace), a minimal `/dev`, a small `/dev/shm`
then the root tmpfs is remounted read-only.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
SCRATCH = "/scratch"
TMP = "/tmp"  # noqa: S108 - a path inside the sandbox


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
    etc_dir: str  # host directory holding resolv.conf, hosts, hostname for the sandbox
    uid: int
    gid: int
    hostname: str = "sandbox"
    system: tuple[Bind, ...] = ()
    inputs: tuple[Bind, ...] = ()
    shm_size: int = 16 * 2**20
    cgroup_procs: tuple[str, ...] = ()  # joined first, before anything else runs
    etc_files: tuple[str, ...] = ("resolv.conf", "hosts", "hostname")
    extra: dict[str, str] = field(default_factory=dict)


def _q(s: str) -> str:
    return shlex.quote(s)


RESERVED = ("/scratch", "/tmp", "/proc", "/dev", "/.oldroot")  # noqa: S108


def _guest(path: str) -> str:
    if (not path.startswith("/") or "\0" in path or "/../" in path + "/"
            or "/./" in path + "/" or path.rstrip("/") == ""):
        raise ValueError(f"guest path must be absolute and normalised: {path!r}")
    return path.rstrip("/")


def check_input_target(path: str) -> str:
    """Inputs may not shadow the sandbox's own mounts (scratch, /proc, /dev)."""
    p = _guest(path)
    for r in RESERVED:
        if p == r or p.startswith(r + "/"):
            raise ValueError(f"input target {path!r} is inside reserved {r}")
    return p


def build(plan: InitPlan) -> str:
    r = plan.root
    lines = [
        "set -eu",
        "umask 022",
        # "0" is the writer itself: everything from here on is counted and killable
        *(f"echo 0 > {_q(p)}" for p in plan.cgroup_procs),
        f"mount -t tmpfs -o size=4m,mode=0755,nosuid,nodev stockade-root {_q(r)}",
    ]
    # /proc/sys/net here still reflects this process's netns: IPv6 off before anything runs
    lines += [
        "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 2>/dev/null || true",
        "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6 2>/dev/null || true",
        f"echo {_q(plan.hostname)} > /proc/sys/kernel/hostname",
        # unprivileged ICMP sockets: a ping gets a legible "prohibited" (nft still rejects it)
        "echo '0 2147483647' > /proc/sys/net/ipv4/ping_group_range 2>/dev/null || true",
    ]
    for b in plan.system:
        t = r + _guest(b.target)
        if b.symlink_to is not None:
            lines.append(f"ln -s {_q(b.symlink_to)} {_q(t)}")
            continue
        lines.append(f"mkdir -p {_q(t)}" if b.is_dir else
                     f"mkdir -p {_q(t.rsplit('/', 1)[0])} && : > {_q(t)}")
        lines.append(f"mount --bind -o ro,nosuid,nodev {_q(b.source)} {_q(t)}")
    for name in plan.etc_files:
        t = f"{r}/etc/{name}"
        src = f"{plan.etc_dir}/{name}"
        # the host /etc is bound read-only: a missing file cannot be created, so skip it
        lines.append(f"if [ -f {_q(t)} ]; then mount --bind -o ro {_q(src)} {_q(t)}; fi")
    s = r + SCRATCH
    lines += [
        # the sandbox's /tmp is a directory of the scratch tmpfs (size-capped with it)
        f"mkdir -p {_q(s)} {_q(r + TMP)}",
        f"mount --bind {_q(plan.scratch)} {_q(s)}",
        f"mount --bind {_q(plan.scratch + TMP)} {_q(r + TMP)}",
    ]
    for b in plan.inputs:
        t = r + check_input_target(b.target)
        lines.append(f"mkdir -p {_q(t)}" if b.is_dir else
                     f"mkdir -p {_q(t.rsplit('/', 1)[0])} && : > {_q(t)}")
        lines.append(f"mount --bind -o ro,nosuid,nodev {_q(b.source)} {_q(t)}")
    d = r + "/dev"
    lines += [
        f"mkdir -p {_q(r + '/proc')} {_q(d)}",
        f"mount -t proc -o nosuid,nodev,noexec proc {_q(r + '/proc')}",
        f"mount -t tmpfs -o size=64k,mode=0755,nosuid stockade-dev {_q(d)}",
    ]
    for dev in DEVICES:
        lines.append(f": > {_q(d + '/' + dev)} && mount --bind /dev/{dev} {_q(d + '/' + dev)}")
    lines += [
        f"ln -s /proc/self/fd {_q(d + '/fd')}",
        f"ln -s /proc/self/fd/0 {_q(d + '/stdin')}",
        f"ln -s /proc/self/fd/1 {_q(d + '/stdout')}",
        f"ln -s /proc/self/fd/2 {_q(d + '/stderr')}",
        f"mkdir {_q(d + '/shm')}",
        f"mount -t tmpfs -o size={plan.shm_size},mode=1777,nosuid,nodev stockade-shm "
        f"{_q(d + '/shm')}",
        f"mkdir {_q(r + '/.oldroot')}",
        f"mount -o remount,ro,bind {_q(d)}",
        f"cd {_q(r)}",
        "pivot_root . .oldroot",
        "umount -l /.oldroot",
        "mount -o remount,ro,nosuid,nodev /",
        f"cd {SCRATCH}",
        "unset OLDPWD",
        # not exec'd: as pid 1 this shell outlives a command killed by a signal and turns
        # it into the usual 128+N status (unshare cannot re-raise SIGKILL on itself)
        f"setpriv --reuid={plan.uid} --regid={plan.gid} --clear-groups "
        "--inh-caps=-all --bounding-set=-all --no-new-privs -- \"$@\"",
        "exit $?",
    ]
    return "\n".join(lines) + "\n"
