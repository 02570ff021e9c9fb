"""mount(2)/umount2(2) through libc for the host-side scratch tmpfs: the launcher mounts
one per sandbox on the hot path, and a syscall costs far less than spawning mount(8).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MNT_DETACH = 2


def mount_tmpfs(target: str, size: int, uid: int, gid: int, mode: int = 0o700) -> None:
    opts = f"size={size},uid={uid},gid={gid},mode={mode:o}".encode()
    if _libc.mount(b"stockade-scratch", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                   opts) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount tmpfs on {target}: {os.strerror(e)}")


def bind_ro(source: str, target: str) -> None:
    """A read-only, nosuid, nodev bind of `source` at `target` (not recursive: what is
    mounted below `source` is not shown), read-only in the host's kernel itself."""
    for flags in (MS_BIND, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV):
        if _libc.mount(source.encode(), target.encode(), None, flags, None) != 0:
            e = ctypes.get_errno()
            if flags != MS_BIND:
                umount(target)
            raise OSError(e, f"read-only bind of {source} on {target}: {os.strerror(e)}")


def private_dir(path: str | os.PathLike[str]) -> None:
    """Create `path` (and parents) as root's 0700 directory, tightening an existing one.

    The sandboxes' scratch root: QEMU (which runs as sandbox_uid, with no chroot) opens
    its shares before it drops privileges, and a netns sandbox sees only its own binds, so
    nothing needs to pass it; 0700 leaves no path from one sandbox to another's files even
    where an operator created the directory with a laxer mode.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def umount(target: str) -> bool:
    """Lazy unmount; False when nothing was mounted there."""
    return bool(_libc.umount2(target.encode(), MNT_DETACH) == 0)


def is_mountpoint(path: str) -> bool:
    return os.path.ismount(path)
