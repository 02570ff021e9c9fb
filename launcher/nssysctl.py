"""Writes of a network namespace's sysctls from the launcher's own process: one thread
enters the namespace (setns(2) changes only the calling thread's namespace) and writes
/proc/sys/net, whose files resolve against the opener's netns. On the gVisor start path
this replaces an nsenter + sysctl(8) spawn per call."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
CLONE_NEWNET = 0x40000000


def _path(key: str) -> str:
    parts = key.split(".")
    if parts[0] != "net" or not all(p and p not in (".", "..") and "/" not in p
                                    for p in parts):
        raise ValueError(f"not a net.* sysctl: {key!r}")
    return "/proc/sys/" + "/".join(parts)


def _write_all(nsfd: int, values: list[tuple[str, str]], strict: bool,
               errors: list[str]) -> None:
    if _libc.setns(nsfd, CLONE_NEWNET) != 0:
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


def write(netns_path: str, values: list[tuple[str, str]], strict: bool = True) -> None:
    """Set `values` ((net.* key, value) pairs, in order) in the namespace at `netns_path`.
    strict: the first failure raises OSError; else failures are ignored (best effort)."""
    for key, _ in values:
        _path(key)  # a bad key is refused before anything is written
    nsfd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    errors: list[str] = []
    try:
        # a thread of its own: the launcher's other threads stay in the host's namespace,
        # and this one ends (taking its namespace reference) right after the writes
        t = threading.Thread(target=_write_all, args=(nsfd, values, strict, errors),
                             name="netns-sysctl", daemon=True)
        t.start()
        t.join()
    finally:
        os.close(nsfd)
    if errors:
        raise OSError(f"cannot set sysctls in {netns_path}: {errors[0]}")
