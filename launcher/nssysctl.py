"""Writes of network sysctls from the launcher's own process: one thread enters the
sandbox's network namespace (setns(2) changes only the calling thread's namespace) and
writes /proc/sys/net, whose files resolve against the opener's netns. On the gVisor start
path this replaces an nsenter + sysctl(8) spawn per call; the host-side veth's ARP
settings (`netns.harden_host_side`) go through here too, without a namespace.

Container runtimes mount /proc/sys read-only in every unprivileged container (the Helm
chart's launcher is one). A process in the initial user namespace with CAP_SYS_ADMIN may
still mount a fresh procfs, which has no such overlay: the writing thread then takes a
mount namespace of its own and mounts one over /proc there. Nothing else of the launcher
(nor the container) sees that mount, and it goes with the thread. When that is not
allowed either, the write fails with an error that says so (fail closed: a sandbox whose
sysctls cannot be set does not start)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MS_REC, MS_PRIVATE = 0x4000, 0x40000
PROC_SYS = "/proc/sys"


def _path(key: str) -> str:
    parts = key.split(".")
    if parts[0] != "net" or not all(p and p not in (".", "..") and "/" not in p
                                    for p in parts):
        raise ValueError(f"not a net.* sysctl: {key!r}")
    return PROC_SYS + "/" + "/".join(parts)


def read_only(path: str = PROC_SYS) -> bool:
    """Whether `path` is on a read-only mount (a container's /proc/sys)."""
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _call(what: str, rc: int) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _private_proc() -> None:
    """This thread only: its own mount namespace (unshare implies its own fs context),
    nothing propagated back, and a fresh procfs over /proc, whose /proc/sys is writable."""
    try:
        _call("unshare(CLONE_NEWNS)", _libc.unshare(CLONE_NEWNS))
        _call("making / private", _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None))
        _call("mount proc", _libc.mount(b"proc", b"/proc", b"proc",
                                        MS_NOSUID | MS_NODEV | MS_NOEXEC, None))
    except OSError as e:
        raise OSError(e.errno, f"{PROC_SYS} is read-only and no private procfs could be "
                      f"mounted ({e.strerror}; the launcher needs CAP_SYS_ADMIN in the "
                      "initial user namespace, or a writable /proc/sys)") from None


def _write_all(nsfd: int | None, values: list[tuple[str, str]], strict: bool,
               errors: list[str]) -> None:
    try:
        if read_only():
            _private_proc()
    except OSError as e:
        errors.append(e.strerror or str(e))
        return
    if nsfd is not None and _libc.setns(nsfd, CLONE_NEWNET) != 0:
        errors.append(f"setns: {os.strerror(ctypes.get_errno())}")
        return
    for key, value in values:
        try:
            with open(_path(key), "w") as f:
                f.write(value)
        except (OSError, ValueError) as e:
            if strict:
                errors.append(f"{key}={value}: {getattr(e, 'strerror', None) or e}")
                return


def write(netns_path: str | None, values: list[tuple[str, str]], strict: bool = True
          ) -> None:
    """Set `values` ((net.* key, value) pairs, in order) in the namespace at `netns_path`
    (None: the launcher's own). strict: the first failure raises OSError; else failures
    of single values are ignored (best effort). A /proc/sys that cannot be made writable
    raises either way."""
    for key, _ in values:
        _path(key)  # a bad key is refused before anything is written
    nsfd = None if netns_path is None else os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    errors: list[str] = []
    try:
        # a thread of its own: the launcher's other threads stay in the host's namespaces,
        # and this one ends (taking its namespace references) right after the writes
        t = threading.Thread(target=_write_all, args=(nsfd, values, strict, errors),
                             name="netns-sysctl", daemon=True)
        t.start()
        t.join()
    finally:
        if nsfd is not None:
            os.close(nsfd)
    if errors:
        raise OSError(f"cannot set sysctls in {netns_path or 'the host namespace'}: "
                      f"{errors[0]}")
