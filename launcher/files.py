"""File operations confined to a session's scratch directory (host side).

Every path is relative to the scratch root and resolved beneath it by the kernel:
`openat2(2)` with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS (no
symlink anywhere, no `..` out, decided atomically, so a symlink swapped in while we work
cannot redirect us), or, where the kernel lacks openat2, a walk that opens one component
at a time with O_NOFOLLOW from the directory fd before it. The sandbox owns the files
(it can change them at any moment): we only ever act through fds we resolved this way.

A write goes to a fresh temporary file in the target's directory and is renamed over the
target once complete, so a refused (oversized, full disk) upload leaves the old file as
it was. Created directories and files belong to the sandbox user.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SYS_OPENAT2 = 437  # x86_64 and aarch64 alike
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x02, 0x04, 0x08
RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
RENAME_NOREPLACE = 1
MAX_PATH = 4096
MAX_ENTRIES = 10000  # a listing longer than this is cut (a directory of millions)
TMP_PREFIX = ".stockade-upload-"

_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


class FileError(Exception):
    """A refused file operation: `code` is the API's error code, `status` its HTTP status."""

    def __init__(self, code: str, status: int, detail: str) -> None:
        super().__init__(detail)
        self.code, self.status, self.detail = code, status, detail


@dataclass(frozen=True)
class Owner:
    uid: int
    gid: int


def check_rel(path: str, *, allow_root: bool = False) -> list[str]:
    """The components of a relative, normalised path (pure); FileError otherwise."""
    if "\0" in path or len(path) > MAX_PATH:
        raise FileError("path_refused", 400, "path contains NUL or is too long")
    if path.startswith("/"):
        raise FileError("path_refused", 400, f"path must be relative to scratch: {path!r}")
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts) or (not parts and not allow_root):
        raise FileError("path_refused", 400, f"path must be normalised, without '.' or "
                                             f"'..': {path!r}")
    return parts


_openat2_works: bool | None = None  # None: not tried yet


def _openat2(dirfd: int, path: str, flags: int, mode: int) -> int:
    global _openat2_works
    how = _OpenHow(flags | os.O_CLOEXEC, mode, RESOLVE)
    fd = _libc.syscall(SYS_OPENAT2, dirfd, path.encode(), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd >= 0:
        _openat2_works = True
        return int(fd)
    e = ctypes.get_errno()
    if e in (errno.ENOSYS, errno.EPERM) and not _openat2_works:
        _openat2_works = False  # no openat2 (or a seccomp filter forbids it): walk
        return _walk(dirfd, path.split("/"), flags, mode)
    raise OSError(e, os.strerror(e), path)


def _walk(dirfd: int, parts: list[str], flags: int, mode: int) -> int:
    """The fallback: each component opened with O_NOFOLLOW from the fd before it."""
    fd = os.dup(dirfd)
    try:
        for p in parts[:-1]:
            nxt = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def open_beneath(dirfd: int, parts: list[str], flags: int, mode: int = 0) -> int:
    """An fd of `parts` beneath `dirfd`, no symlink followed; FileError for refusals."""
    path = "/".join(parts) or "."
    try:
        if _openat2_works is False:
            return _walk(dirfd, path.split("/"), flags, mode)
        return _openat2(dirfd, path, flags, mode)
    except OSError as e:
        raise _refusal(e, path) from None


def _refusal(e: OSError, path: str) -> FileError:
    if e.errno == errno.ENOENT:
        return FileError("not_found", 404, f"no such file or directory: {path}")
    if e.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
        return FileError("path_refused", 400, f"path goes through a symlink or a "
                                              f"non-directory: {path}")
    if e.errno == errno.EISDIR:
        return FileError("path_refused", 400, f"is a directory: {path}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return FileError("too_large", 413, "the session's scratch is full")
    return FileError("path_refused", 400, f"{path}: {e.strerror}")


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _root(root: str) -> int:
    """The fd of the scratch tmpfs's root. Refused (session_ended) once the session's
    teardown unmounted or removed it: a write would then land on the host's disk under
    it, beyond the tmpfs's size, and be left behind. (An fd taken while it was mounted
    keeps the lazily unmounted tmpfs alive until it is closed.)"""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise _ended() from None
    try:
        parent = os.stat(os.path.dirname(os.path.normpath(root)))
        mounted = os.fstat(fd).st_dev != parent.st_dev
    except OSError:
        mounted = False
    if not mounted:
        os.close(fd)
        raise _ended()
    return fd


def _ended() -> FileError:
    return FileError("session_ended", 409, "the session's scratch is no longer mounted")


def _parent(rootfd: int, parts: list[str], owner: Owner) -> int:
    """The fd of the target's directory, creating missing directories (the sandbox's)."""
    fd = os.dup(rootfd)
    try:
        for p in parts:
            try:
                nxt = open_beneath(fd, [p], os.O_RDONLY | os.O_DIRECTORY)
            except FileError as e:
                if e.code != "not_found":
                    raise
                _mkdir_owned(fd, p, owner)
                nxt = open_beneath(fd, [p], os.O_RDONLY | os.O_DIRECTORY)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _mkdir_owned(dirfd: int, name: str, owner: Owner) -> None:
    """`name` appears already the sandbox's: made and chowned under a hidden temporary
    name, then renamed into place (a root-owned moment would make a sandbox writer's
    mkdir or create there fail with EACCES)."""
    tmp = TMP_PREFIX + secrets.token_hex(8)
    try:
        os.mkdir(tmp, 0o755, dir_fd=dirfd)
    except OSError as e:
        raise _refusal(e, name) from None
    try:
        with _fd(open_beneath(dirfd, [tmp], os.O_RDONLY | os.O_DIRECTORY)) as fd:
            os.fchown(fd, owner.uid, owner.gid)
        _rename_noreplace(dirfd, tmp, name)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.rmdir(tmp, dir_fd=dirfd)
        if isinstance(e, FileExistsError):  # the sandbox made `name` meanwhile: keep it
            return
        if isinstance(e, OSError):
            raise _refusal(e, name) from None
        raise


def _rename_noreplace(dirfd: int, src: str, dst: str) -> None:
    """renameat2(RENAME_NOREPLACE): never over a directory a racing sandbox just made."""
    if _libc.renameat2(dirfd, src.encode(), dirfd, dst.encode(), RENAME_NOREPLACE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), dst)


def write(root: str, path: str, chunks: Iterator[bytes | bytearray], limit: int,
          owner: Owner) -> int:
    """Write the file `path` under `root` from `chunks`; its size. At most `limit` bytes
    (FileError too_large, the old file untouched)."""
    parts = check_rel(path)
    if parts[-1].startswith(TMP_PREFIX):
        raise FileError("path_refused", 400, f"names starting {TMP_PREFIX} are reserved")
    with _fd(_root(root)) as rootfd, _fd(_parent(rootfd, parts[:-1], owner)) as pfd:
        _refuse_symlink(pfd, parts[-1], path)
        tmp = TMP_PREFIX + secrets.token_hex(8)
        size = 0
        try:
            with _fd(open_beneath(pfd, [tmp], os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                  0o644)) as fd:
                os.fchown(fd, owner.uid, owner.gid)
                for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise FileError("too_large", 413, f"a file may hold at most "
                                                          f"{limit} bytes")
                    _write_all(fd, chunk)
            os.rename(tmp, parts[-1], src_dir_fd=pfd, dst_dir_fd=pfd)
        except OSError as e:
            _unlink(pfd, tmp)
            raise _refusal(e, path) from None
        except BaseException:
            _unlink(pfd, tmp)
            raise
    return size


def _refuse_symlink(dirfd: int, name: str, path: str) -> None:
    """A symlink at the target is refused like one on the way. (One swapped in after
    this check is only replaced by the rename: a rename never follows it.)"""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise FileError("path_refused", 400, f"path is a symlink: {path}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _unlink(dirfd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dirfd)


def read(root: str, path: str, limit: int) -> bytes:
    """The regular file `path` under `root` (FileError: not one, or over `limit`)."""
    parts = check_rel(path)
    # O_NONBLOCK: a FIFO the sandbox planted would block the open until a writer came;
    # it is refused below like any non-file (a regular file ignores the flag)
    flags = os.O_RDONLY | os.O_NONBLOCK
    with _fd(_root(root)) as rootfd, _fd(open_beneath(rootfd, parts, flags)) as fd:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileError("path_refused", 400, f"not a regular file: {path}")
        if st.st_size > limit:
            raise FileError("too_large", 413, f"{path} holds {st.st_size} bytes, more than "
                                              f"the {limit} a read may return")
        data = bytearray()  # appended in place: `bytes +=` copied it all on every read
        while len(data) <= limit and (chunk := os.read(fd, 1 << 20)):
            data += chunk
        if len(data) > limit:  # grew while we read
            raise FileError("too_large", 413, f"{path} is larger than {limit} bytes")
        return bytes(data)


def listing(root: str, path: str) -> list[dict[str, Any]]:
    """The entries of the directory `path` under `root` ("" or ".": the root itself)."""
    parts = check_rel(path if path != "." else "", allow_root=True)
    out = []
    with (_fd(_root(root)) as rootfd,
          _fd(open_beneath(rootfd, parts, os.O_RDONLY | os.O_DIRECTORY)) as fd,
          os.scandir(fd) as it):  # scandir works on a duplicate: ours is closed here
        for entry in it:
            if len(out) >= MAX_ENTRIES:  # stop reading: the sandbox may have made millions
                break
            if not entry.name.startswith(TMP_PREFIX):
                out.append(_entry(entry))
    return sorted(out, key=lambda e: e["name"])


def _entry(entry: os.DirEntry[str]) -> dict[str, Any]:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return {"name": entry.name, "type": "other", "size": 0}
    kind = ("symlink" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode)
            else "file" if stat.S_ISREG(st.st_mode) else "other")
    return {"name": entry.name, "type": kind, "size": st.st_size if kind == "file" else 0}
