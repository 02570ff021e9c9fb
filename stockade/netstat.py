"""The kernel's TCP listen-queue drop counter of a network namespace (`TcpExt:
ListenDrops` in /proc/net/netstat). A connection whose handshake the kernel finished while
a listener's accept queue was full is dropped there and never reaches the listener: the
gateway can give it no decision, so it reports the namespace's count instead (all of the
namespace's listeners together; the kernel keeps no count per socket)."""

from __future__ import annotations

from pathlib import Path

NETSTAT = Path("/proc/self/net/netstat")  # this process's network namespace


def listen_drops_of(text: str) -> int | None:
    """`ListenDrops` of a /proc/net/netstat text (header line, then values), or None."""
    lines = [line.split() for line in text.splitlines() if line.startswith("TcpExt:")]
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if "ListenDrops" in names and len(values) == len(names):
            try:
                return int(values[names.index("ListenDrops")])
            except ValueError:
                return None
    return None


def listen_drops(path: Path = NETSTAT) -> int | None:
    """The namespace's count now (None where the kernel does not show it)."""
    try:
        return listen_drops_of(path.read_text())
    except OSError:
        return None
