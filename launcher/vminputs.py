"""A pooled microVM's inputs at its claim: its 9p shares are fixed when QEMU starts, so the
claim reads the inputs on the host into entries of the plan it sends on the agent port
(virtio-serial, never a network), and the guest's init (`guest_inputs.py`) writes them to
a tmpfs of their size, read-only once written, bound read-only at their targets.

The discipline is the gVisor claim's (`backends/gvisor_host.copy_inputs`): files, trees
(symlinks as symlinks, FIFOs remade) with their permission bits less every write bit; a
device or a socket in an input is refused by name, as is a target the guest already has
(checked in the guest). The guest makes every entry root's: the sandbox user owns none.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import Any

from .initscript import Bind
from .microvm import MIB, check_guest_path

# the inputs' bytes in one claim: the plan that carries them is at most
# microvm.MAX_PLAN_BYTES (16 MiB), which the seccomp filter, stdin and names share
MAX_INPUT_BYTES = 8 * MIB
MAX_INPUT_ENTRIES = 4096
# the guest's init says this on the agent port once the inputs are mounted
# (guest_inputs.INPUTS_READY; that module imports nothing of the launcher)
INPUTS_READY = b"stockade-inputs-ready\n"
_PAGE = 4096


class InputRefused(ValueError):
    """An input a pooled microVM cannot take; the message names it."""


def pack(inputs: Sequence[Bind], cap: int = MAX_INPUT_BYTES,
         max_entries: int = MAX_INPUT_ENTRIES) -> dict[str, Any]:
    """The plan's `claim_inputs`: `entries` (kind, relative path, mode, data) in creation
    order (parents first; input i's root is "i"), `targets` (input i's guest path), and
    `size`, the tmpfs that holds them. InputRefused for a device, a socket, more than
    `cap` bytes or `max_entries` entries."""
    walk = _Walk(cap, max_entries, read=True)
    for i, b in enumerate(inputs):
        walk.entry(b.source, str(i), b.target, top=True)
    # a target is the rest of an input table's line: absolute, normalised, no newline
    return {"entries": walk.entries, "targets": [check_guest_path(b.target) for b in inputs],
            "size": walk.bytes + (len(walk.entries) + 16) * _PAGE}


def check(inputs: Sequence[Bind], cap: int = MAX_INPUT_BYTES,
          max_entries: int = MAX_INPUT_ENTRIES) -> None:
    """`pack`'s refusals from the inputs' metadata alone (nothing read): before a claim
    takes a pooled guest, so a refused task uses none up (`pack` checks again)."""
    walk = _Walk(cap, max_entries, read=False)
    for i, b in enumerate(inputs):
        walk.entry(b.source, str(i), b.target, top=True)


class _Walk:
    def __init__(self, cap: int, max_entries: int, read: bool) -> None:
        self.cap, self.max_entries, self.read = cap, max_entries, read
        self.entries: list[tuple[str, str, int, bytes | str]] = []
        self.bytes = 0

    def add(self, kind: str, rel: str, mode: int, data: bytes | str, name: str,
            size: int | None = None) -> None:
        if len(self.entries) >= self.max_entries:
            raise InputRefused(f"input {name}: over {self.max_entries} files and "
                               "directories, more than a pooled microVM takes")
        self.bytes += len(data) if size is None else size
        if self.bytes > self.cap:
            raise InputRefused(f"input {name}: the inputs are over {self.cap} bytes, more "
                               "than a pooled microVM takes")
        self.entries.append((kind, rel, stat.S_IMODE(mode) & 0o555, data))

    def entry(self, source: str, rel: str, name: str, top: bool = False) -> None:
        st = os.lstat(source)
        # a file input is readable by all, as a cold start's staged copy (0644 there)
        mode = 0o444 if top and stat.S_ISREG(st.st_mode) else st.st_mode
        if stat.S_ISLNK(st.st_mode):
            self.add("link", rel, 0o777, os.readlink(source), name)
        elif stat.S_ISDIR(st.st_mode):
            self.add("dir", rel, st.st_mode, b"", name)
            for entry in sorted(os.listdir(source)):
                self.entry(os.path.join(source, entry), f"{rel}/{entry}", f"{name}/{entry}")
        elif stat.S_ISREG(st.st_mode) and not self.read:
            self.add("file", rel, mode, b"", name, st.st_size)
        elif stat.S_ISREG(st.st_mode):
            self.add("file", rel, mode, self._read(source, name), name)
        elif stat.S_ISFIFO(st.st_mode):
            self.add("fifo", rel, st.st_mode, b"", name)
        else:
            raise InputRefused(f"input {name} is a device or a socket: a pooled microVM "
                               "copies its inputs and copies only files, directories, "
                               "symlinks and FIFOs")

    def _read(self, source: str, name: str) -> bytes:
        # no symlink swapped in, no FIFO opened for a file since the lstat; no more read
        # than the cap leaves
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InputRefused(f"input {name} changed while it was read")
            left, chunks = self.cap - self.bytes + 1, []
            while left > 0 and (chunk := os.read(fd, min(left, MIB))):
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
