"""The snapshot templates' cache: which template a start may restore, whether its file is
whole, and building one when a shape has none (launcher/vmsnapshot.py saves and restores).

A template is `<key>.vmstate` with a sidecar `<key>.json` (its size and SHA-256), both in
`<state_dir>/microvm-snapshots/`. The key (`vmsnapshot.shape_key`) covers the QEMU binary,
kernel and initramfs files (path, size, mtime, inode: a rebuilt image or an upgraded QEMU
is another key, so its template is built anew) and the machine shape. A file is checked
before its first restore in each process (the sidecar, QEMU's header, the digest); one that
fails is removed, the start boots cold and says why (`Bad`), and the next build replaces
it. A template whose key is superseded (one of its files was rebuilt, replaced or removed:
no start computes its key again) is removed by the next build in its directory, so a
rebuilt image leaves no 65 MiB file behind per shape: its sidecar names the files with
their identities when it was saved (`superseded`). Builds run one at a time per state
directory (a flock: two launchers starting at once build it once) and, on a task's path,
in the background (`build_later`): the task that found no template boots cold now and
later ones restore.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from . import microvm, vmsnapshot

log = logging.getLogger("stockade.launcher.vmtemplates")
META = ".json"
# QEMU's migration stream starts with QEMU_VM_FILE_MAGIC and QEMU_VM_FILE_VERSION 3
MAGIC = b"QEVM\x00\x00\x00\x03"
BUILD_TIMEOUT_S = 300.0


class Bad(Exception):
    """A template that may not be restored (removed already); the message says why."""


def meta_path(vmstate: Path) -> Path:
    return vmstate.with_suffix(META)


def digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def problem(vmstate: Path, verify_digest: bool = True) -> str | None:
    """Why `vmstate` is not a whole template (None: it is)."""
    try:
        meta = json.loads(meta_path(vmstate).read_text())
        size, want = int(meta["size"]), str(meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "its sidecar is missing or unreadable"
    try:
        st = vmstate.stat()
        with open(vmstate, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    if st.st_size != size:
        return f"it has {st.st_size} bytes, its sidecar says {size}"
    if head != MAGIC:
        return "it is not a QEMU migration stream"
    if verify_digest and digest(vmstate) != want:
        return "its SHA-256 differs from its sidecar's"
    return None


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[Path]:
    d = state_dir / vmsnapshot.SNAP_DIR
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(d / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield d


def superseded(snap_dir: Path) -> list[Path]:
    """The templates in `snap_dir` whose QEMU binary, kernel or initramfs is no longer the
    file it was saved with (sidecars of older launchers, without the files, are kept)."""
    out = []
    for meta in sorted(snap_dir.glob(f"*{META}")):
        if meta.name.startswith("."):
            continue  # a sidecar being written
        try:
            files = json.loads(meta.read_text())["files"]
            stale = any(vmsnapshot.file_identity(f) != ident for f, ident in files.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if stale:
            out.append(meta.with_suffix(vmsnapshot.SUFFIX))
    return out


def _remove(vmstate: Path) -> None:
    for p in (vmstate, meta_path(vmstate)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


class Templates:
    """One launcher process's view of the cache (the backend holds one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verified: set[tuple[str, int, int, int]] = set()  # (path, ino, size, mtime)
        self._building: set[str] = set()

    def lookup(self, state_dir: Path, key: str) -> Path | None:
        """The template of `key` when it is whole; None when there is none; Bad (and the
        file removed) when it is corrupt."""
        p = vmsnapshot.template_path(state_dir, key)
        try:
            st = p.stat()
        except FileNotFoundError:
            return None
        ident = (str(p), st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            known = ident in self._verified
        why = problem(p, verify_digest=not known)
        if why is None:
            with self._lock:
                self._verified.add(ident)
            return p
        self.drop(state_dir, key)
        raise Bad(f"the snapshot template {p.name} was not used: {why}")

    def drop(self, state_dir: Path, key: str) -> None:
        """Remove the template of `key` (QEMU refused it, or it is corrupt)."""
        p = vmsnapshot.template_path(state_dir, key)
        with _locked(state_dir):
            _remove(p)
        with self._lock:
            self._verified = {v for v in self._verified if v[0] != str(p)}

    def build_now(self, shape: microvm.VmSpec, stamp: str, state_dir: Path,
                  timeout_s: float = BUILD_TIMEOUT_S) -> Path:
        """The template of `shape`, saved first when there is none or it is not whole
        (SnapshotError: it could not be). One build at a time per state directory, any
        process: the others wait and find it done."""
        key = vmsnapshot.shape_key(shape, stamp)
        dest = vmsnapshot.template_path(state_dir, key)
        with _locked(state_dir):
            if dest.is_file() and problem(dest, verify_digest=False) is None:
                return dest
            _remove(dest)
            vmsnapshot.save_template(shape, dest, timeout_s)
            tmp = dest.with_name(f".{dest.stem}.{os.getpid()}{META}")
            tmp.write_text(json.dumps({"size": dest.stat().st_size, "sha256": digest(dest),
                                       "key": key, "files": vmsnapshot.image_files(shape)}))
            os.replace(tmp, meta_path(dest))
            for old in superseded(dest.parent):  # a restore in progress keeps its open fd
                log.info("removing the superseded microVM snapshot template %s", old.name)
                _remove(old)
        return dest

    def build_later(self, shape: microvm.VmSpec, stamp: str, state_dir: Path) -> bool:
        """Build the template of `shape` in a background thread unless one is being built
        by this process; False when it already is."""
        key = vmsnapshot.shape_key(shape, stamp)
        with self._lock:
            if key in self._building:
                return False
            self._building.add(key)

        def build() -> None:
            try:
                self.build_now(shape, stamp, state_dir)
            except (OSError, vmsnapshot.SnapshotError) as e:
                log.warning("the microVM snapshot template %s was not built: %s", key, e)
            finally:
                with self._lock:
                    self._building.discard(key)

        threading.Thread(target=build, name=f"stk-vmtemplate-{key[:8]}", daemon=True).start()
        return True

    def building(self) -> set[str]:
        with self._lock:
            return set(self._building)
