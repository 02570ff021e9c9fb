"""A ConfigMap volume as the kubelet writes it (its AtomicWriter), for the rule watches.

The files live in a `..<timestamp>` directory; `..data` is a symlink to it and every
top-level entry is a symlink through `..data`. An update writes a new timestamped directory,
points a `..data_tmp` symlink at it and renames that over `..data` (one rename(2)), then
removes the old directory: a reader sees the old tree or the new one, and every file's path
under the real directory changes at once.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (relative path -> content), e.g. a rules directory."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def project(volume: Path, files: dict[str, bytes]) -> None:
    """Make `volume` hold exactly `files`, swapped in the kubelet's way."""
    volume.mkdir(parents=True, exist_ok=True)
    data = volume / "..data"
    old = os.readlink(data) if data.is_symlink() else None
    stamp = volume / f"..2026_01_01_00_00_00.{uuid.uuid4().hex[:9]}"
    for rel, content in files.items():
        path = stamp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    tmp = volume / "..data_tmp"
    os.symlink(stamp.name, tmp)
    os.rename(tmp, data)
    tops = {rel.split("/", 1)[0] for rel in files}
    for top in tops:
        if not (volume / top).is_symlink():
            os.symlink(f"..data/{top}", volume / top)
    for entry in volume.iterdir():
        if not entry.name.startswith("..") and entry.name not in tops:
            entry.unlink()
    if old is not None:
        shutil.rmtree(volume / old)
