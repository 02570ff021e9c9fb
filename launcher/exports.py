"""Exports: which files under the sandbox's `scratch/out` leave it (pure decision + a thin
copier). The type is decided by content (magic bytes, JSON parse, UTF-8), never by name.
Symlinks, devices and other non-regular files are refused: a link would be followed on
the host, where its target means something else.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stockade.events import make_event

from .spec import ExportedFile

# magic bytes -> type name usable in a profile's `exports.types`
MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", 0, "png"),
    (b"\xff\xd8\xff", 0, "jpeg"),
    (b"GIF87a", 0, "gif"),
    (b"GIF89a", 0, "gif"),
    (b"%PDF-", 0, "pdf"),
    (b"\x1f\x8b", 0, "gzip"),
    (b"PK\x03\x04", 0, "zip"),
    (b"ustar", 257, "tar"),
)


def sniff(data: bytes) -> str | None:
    """Content type: a magic-byte type, 'json', 'text' (UTF-8 without NUL) or None."""
    for magic, off, name in MAGIC:
        if data[off : off + len(magic)] == magic:
            return name
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "\0" in text:
        return None
    stripped = text.strip()
    if stripped[:1] in ("{", "[") or stripped in ("null", "true", "false"):
        try:
            json.loads(text)
            return "json"
        except ValueError:
            pass
    return "text"


def type_allowed(kind: str | None, allowed: tuple[str, ...] | list[str]) -> bool:
    if kind is None:
        return False
    # JSON is text: a profile that exports text also takes JSON files
    return kind in allowed or (kind == "json" and "text" in allowed)


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str  # path relative to out/
    size: int
    regular: bool
    kind: str | None


@dataclass(frozen=True, slots=True)
class ExportDecision:
    name: str
    size: int
    kind: str | None
    allowed: bool
    why: str  # "ok" | "not_regular" | "too_large" | "type_not_allowed" | "total_exceeded"


def decide(cands: list[Candidate], max_file: int, max_total: int,
           types: tuple[str, ...] | list[str]) -> list[ExportDecision]:
    out: list[ExportDecision] = []
    total = 0
    for c in sorted(cands, key=lambda c: c.name):
        if not c.regular:
            why = "not_regular"
        elif c.size > max_file:
            why = "too_large"
        elif not type_allowed(c.kind, types):
            why = "type_not_allowed"
        elif total + c.size > max_total:
            why = "total_exceeded"
        else:
            why = "ok"
            total += c.size
        out.append(ExportDecision(c.name, c.size, c.kind, why == "ok", why))
    return out


def _read_nofollow(path: str, limit: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        chunks = []
        left = limit
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def scan(out_dir: str, max_file: int) -> tuple[list[Candidate], dict[str, bytes]]:
    """Candidates under out_dir (not following links) and the content of the readable ones."""
    cands: list[Candidate] = []
    contents: dict[str, bytes] = {}
    base = Path(out_dir)
    if not base.is_dir() or base.is_symlink():
        return cands, contents
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(
                os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, base)
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                cands.append(Candidate(rel, st.st_size, False, None))
                continue
            if st.st_size > max_file:
                cands.append(Candidate(rel, st.st_size, True, None))
                continue
            try:
                data = _read_nofollow(full, max_file + 1)
            except OSError:
                cands.append(Candidate(rel, st.st_size, False, None))
                continue
            contents[rel] = data
            cands.append(Candidate(rel, len(data), True, sniff(data)))
    return cands, contents


def write_export(dest_dir: str, name: str, data: bytes) -> None:
    dest = Path(dest_dir)
    target = (dest / name).resolve()
    if not str(target).startswith(str(dest.resolve()) + os.sep):
        raise ValueError(f"export name escapes the export directory: {name!r}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".stockade-tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)


def export_files(task_id: str, profile_name: str, pol: Any, scratch: str, dest: str,
                 policy_version: str | None,
                 emit: Callable[[dict[str, Any]], None]) -> list[ExportedFile]:
    """Copy what the profile's export policy `pol` lets out of `scratch`/scratch/out into
    `dest`; one `export_decision` event per file."""
    out_dir = str(Path(scratch) / "scratch" / "out")
    cands, contents = scan(out_dir, pol.max_file_bytes)
    result = []
    for d in decide(cands, pol.max_file_bytes, pol.max_total_bytes, pol.types):
        info = {"name": d.name, "size": d.size, "type": d.kind or "unknown"}
        if d.allowed:
            try:
                write_export(dest, d.name, contents[d.name])
            except (OSError, ValueError):
                d = ExportDecision(d.name, d.size, d.kind, False, "write_failed")
        if d.allowed:
            result.append(ExportedFile(d.name, d.size, d.kind or "unknown"))
            emit(make_event(
                component="launcher", action="export_decision", decision="allowed",
                reason="allowed_by_rule", task_id=task_id, profile=profile_name,
                policy_version=policy_version, message=f"exported {d.name}",
                extra={"export": info}))
        else:
            emit(make_event(
                component="launcher", action="export_decision", decision="denied",
                reason="export_refused", task_id=task_id, profile=profile_name,
                policy_version=policy_version,
                message=f"export of {d.name} refused: {d.why}",
                extra={"export": {**info, "why": d.why}}))
    return result
