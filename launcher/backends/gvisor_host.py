"""The host side of the gVisor tier (backends/gvisor.py): the bundle's root directory,
the inputs staged read-only (copied in at a pooled sandbox's claim), the sandbox
namespace's sysctls, and what runsc leaves on the host (cgroup dirs, state files, staged
mounts) of containers no record keeps."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .. import cgroups, gvisor, initscript, mounts, netns, nssysctl
from ..spec import TASK_ID_RE, LauncherError

if TYPE_CHECKING:  # annotations only
    from ..settings import LauncherSettings

STAGED = "inputs-ro"  # <base>/inputs-ro/<n>: the inputs' read-only host binds
# cgroup v1 hierarchies runsc makes <parent>/<id> in besides the launcher's own four
RUNSC_HIERARCHIES = ("blkio", "cpuacct", "cpuset", "devices", "systemd")


def state_root(s: LauncherSettings) -> str:
    """runsc's --root: one per nft table, so launchers on other tables never meet."""
    return os.path.join(s.gvisor.root_dir, s.nft_table)


def stage_inputs(base: Path, inputs: list[initscript.Bind]) -> tuple[initscript.Bind, ...]:
    """Each input through a bind that is read-only in the host's kernel: runsc's gofer
    opens host files as root, and an open(O_TRUNC) of a host file the sandbox user may
    write (mode 0666) truncated it although the OCI mount says "ro" (runsc 20240729)."""
    if not inputs:
        return ()
    staged = base / STAGED
    staged.mkdir(mode=0o711)
    out = []
    for i, b in enumerate(inputs):
        target = staged / str(i)
        if b.is_dir:
            target.mkdir(mode=0o755)
        else:
            target.touch(mode=0o644)
        try:
            mounts.bind_ro(b.source, str(target))
        except OSError as e:
            raise LauncherError(f"cannot stage input {b.target}: {e.strerror}") from None
        out.append(dataclasses.replace(b, source=str(target)))
    return tuple(out)


def unstage(base: Path) -> None:
    staged = base / STAGED
    with contextlib.suppress(OSError):
        for d in staged.iterdir():
            for _ in range(3):
                if not mounts.umount(str(d)):
                    break


GATE = "start-gate"  # <base>/start-gate: the start gate's FIFO (gvisor.start_gate_hook)


def open_gate(base: Path) -> tuple[str, int]:
    """The start gate's FIFO, root's only, beside the bundle (no mount shows it to the
    sandbox), and the fd that holds it open read-write: the hook's open never blocks on
    it, a "go" written before the hook reads stays in the pipe, and closing the fd without
    one (teardown, or the launcher's death) gives the hook EOF: the start fails."""
    path = base / GATE
    try:
        os.mkfifo(path, 0o600)
        return str(path), os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise LauncherError(f"cannot make the gVisor start gate: {e.strerror}") from None


def release_gate(fd: int) -> None:
    try:
        os.write(fd, b"go\n")
    except OSError as e:
        raise LauncherError(f"cannot release the gVisor start gate: {e.strerror}") from None


def netns_sysctls(ns: str, congestion_control: str | None) -> None:
    """What sandbox_init.py sets in the container tier, from the host: IPv6 off, ICMP
    sockets for everyone (nft still rejects them), the TCP default. Written in-process:
    two nsenter + sysctl(8) spawns cost 5-10 ms per start (more under load)."""
    path = f"{netns.NETNS_DIR}/{ns}"
    try:
        nssysctl.write(path, [("net.ipv6.conf.all.disable_ipv6", "1"),
                              ("net.ipv6.conf.default.disable_ipv6", "1"),
                              ("net.ipv4.ping_group_range", "0 2147483647")])
    except OSError as e:
        raise LauncherError(f"cannot set the sandbox's sysctls: {e}") from None
    if congestion_control:  # best effort: an algorithm the kernel lacks keeps the default
        with contextlib.suppress(OSError):
            nssysctl.write(path, [("net.ipv4.tcp_congestion_control", congestion_control)],
                           strict=False)


def materialize(root: Path, layout: gvisor.RootLayout) -> None:
    """The bundle's root directory: only mount points, copied symlinks and copied /etc
    files, root's; it is mounted read-only, so nothing here is ever written by the sandbox."""
    root.mkdir(mode=0o755, exist_ok=True)
    os.chmod(root, 0o755)  # noqa: S103 - the Sentry's gofer reads it as the sandbox user
    for guest in layout.dirs:
        os.makedirs(gvisor.confined(str(root), guest), mode=0o755, exist_ok=True)
    for guest in layout.files:
        p = gvisor.confined(str(root), guest)
        os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
        Path(p).touch(mode=0o644, exist_ok=True)
    for guest, target in layout.symlinks:
        p = gvisor.confined(str(root), guest)
        os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
        os.symlink(target, p)
    for guest, source in layout.copies:
        copy_into(gvisor.confined(str(root), guest), source)


def copy_into(dest: str, source: str) -> None:
    """A host file's bytes at `dest` with its permission bits and owner (a file the
    sandbox user could not read through a bind stays unreadable); set-id bits dropped."""
    os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
    st = os.stat(source)
    shutil.copyfile(source, dest)
    os.chown(dest, st.st_uid, st.st_gid)
    os.chmod(dest, st.st_mode & 0o777)


def copy_inputs(root: Path, inputs: list[initscript.Bind], reserved: tuple[str, ...]) -> None:
    """A pooled sandbox's inputs at its claim: copied into the bundle's root directory
    (read-only to the sandbox: runsc made it a read-only mount when it started, and the
    Sentry sees host changes under `--file-access=shared`). A bind made on the host now
    would not reach the Sentry's and the gofer's mount namespaces (private propagation),
    so the bytes are copied: files with their owner and permission bits less every write
    bit, directories as trees (symlinks as symlinks, FIFOs remade); a device or a socket
    in an input, or a target the root already has, is refused by name."""
    for b in inputs:
        try:
            target = initscript.check_input_target(b.target, extra=reserved)
            dest = gvisor.confined(str(root), target)
        except ValueError as e:
            raise LauncherError(str(e)) from None
        if os.path.lexists(dest):
            raise LauncherError(f"input target {b.target!r} already exists in the sandbox")
        os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
        gvisor.confined(str(root), target)  # the dirs just made lead nowhere else
        try:
            _copy_entry(b.source, dest, b.target)
        except OSError as e:
            raise LauncherError(f"cannot copy input {b.target}: {e.strerror or e}") from None


def _copy_entry(source: str, dest: str, name: str) -> None:
    st = os.lstat(source)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(source), dest)
        os.lchown(dest, st.st_uid, st.st_gid)
        return
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(dest, 0o700)
        for entry in sorted(os.listdir(source)):
            _copy_entry(os.path.join(source, entry), os.path.join(dest, entry),
                        f"{name}/{entry}")
    elif stat.S_ISREG(st.st_mode):
        shutil.copyfile(source, dest, follow_symlinks=False)
    elif stat.S_ISFIFO(st.st_mode):
        os.mkfifo(dest)
    else:
        raise LauncherError(f"input {name} is a device or a socket: a pooled gVisor "
                            "sandbox copies its inputs and copies only files, "
                            "directories, symlinks and FIFOs")
    os.chown(dest, st.st_uid, st.st_gid)
    os.chmod(dest, stat.S_IMODE(st.st_mode) & 0o555)  # no write bit (nor set-id, sticky)


def sweep_host(s: LauncherSettings, keep: set[str]) -> None:
    """What runsc leaves on the host of containers no record keeps: cgroup dirs, staged
    input mounts, state files; with no record at all, the table's state root and the
    cgroup parents runsc made (each removed only once empty)."""
    for name in _runsc_cgroup_names(s):
        if name not in keep:
            remove_runsc_cgroups(s, name)
    with contextlib.suppress(OSError):
        for d in Path(s.scratch_dir).iterdir():
            if d.name not in keep and TASK_ID_RE.match(d.name):
                unstage(d)
    remove_state_files(s, lambda names: gvisor.stale_state_files(names, keep))
    if not keep:
        with contextlib.suppress(OSError):
            Path(state_root(s)).rmdir()
        for h in RUNSC_HIERARCHIES:
            with contextlib.suppress(OSError):
                Path(s.cgroup_root, h, s.cgroup_parent).rmdir()


def state_left(s: LauncherSettings, task_id: str) -> bool:
    """True unless runsc's state root shows nothing of `task_id` but its lock: most ends
    (the command's own, or a kill) need no `delete -force`, which is one more runsc start
    (tens of ms, over a second under load: the gVisor tier's kill-to-gone p95)."""
    try:
        return gvisor.state_left(os.listdir(state_root(s)), task_id)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unreadable: let runsc decide


def remove_state_files(s: LauncherSettings,
                        which: Callable[[list[str]], list[str]]) -> None:
    """runsc's files of gone containers (`delete -force` leaves the `.lock`)."""
    root = Path(state_root(s))
    with contextlib.suppress(OSError):
        for name in which(os.listdir(root)):
            (root / name).unlink(missing_ok=True)


def _runsc_cgroup_names(s: LauncherSettings) -> set[str]:
    names: set[str] = set()
    for h in RUNSC_HIERARCHIES:
        with contextlib.suppress(OSError):
            names.update(p.name for p in Path(s.cgroup_root, h, s.cgroup_parent).iterdir()
                         if p.is_dir())
    return names


def remove_runsc_cgroups(s: LauncherSettings, task_id: str) -> None:
    """The dirs a runsc that died between create and delete leaves (v1 only); then the
    parents it made, once empty (a test launcher's own parent goes with its last sandbox)."""
    if cgroups.detect_version(s.cgroup_root) == 2:
        return
    for h in RUNSC_HIERARCHIES:
        parent = Path(s.cgroup_root, h, s.cgroup_parent)
        for d in (parent / task_id, parent):
            with contextlib.suppress(OSError):
                d.rmdir()
