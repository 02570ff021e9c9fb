"""Checks of a signed task record (record.py): the signature, the rule-set version
against one computed from a rules directory (by the caller: the rule model sits above
this floor), and the record's chain digests against event files. `stockade task verify`
(stockade/stack/taskcli.py) is the shell.

A chain digest holds when a line with that digest is in the files, is the task's and the
component's, and sits at the recorded stream and sequence; and the files' own chains
(verify.py) are intact, so no line before it was removed or edited either.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .chain import digest
from .chainkey import key_id
from .record import Record, RecordError, chain_of, component_of, open_envelope
from .verify import verify_files


@dataclass(frozen=True, slots=True)
class Check:
    name: str  # signature, rules, chain:<component>, events
    ok: bool
    text: str

    def __str__(self) -> str:
        return f"{'ok' if self.ok else 'FAIL'} {self.name}: {self.text}"


def _task_of(ev: dict[str, Any]) -> Any:
    if "class_uid" in ev:
        return ((ev.get("unmapped") or {}).get("labels") or {}).get("task_id")
    return (ev.get("labels") or {}).get("task_id")


def _index(files: list[Path]) -> dict[str, dict[str, Any]]:
    """digest -> event of every line of the files."""
    out: dict[str, dict[str, Any]] = {}
    for f in files:
        for line in f.read_bytes().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                out[digest(line)] = ev
    return out


def check_chains(record: Record, files: list[Path]) -> list[Check]:
    index = _index(files)
    chains = record.get("chains")
    if not isinstance(chains, dict) or not chains:
        return [Check("chains", False, "the record names no event chain")]
    out = []
    for comp, want in sorted(chains.items()):
        name = f"chain:{comp}"
        ev = index.get(str(want.get("digest")) if isinstance(want, dict) else "")
        if ev is None:
            out.append(Check(name, False, f"no line with digest {want.get('digest')} in the "
                             "event files (removed or edited)"))
            continue
        chain, seq = chain_of(ev)
        stream = chain.get("stream") if isinstance(chain, dict) else None
        if _task_of(ev) != record.get("task_id") or component_of(ev) != comp or \
                stream != want.get("stream") or seq != want.get("seq"):
            out.append(Check(name, False, "the line with that digest is not the task's "
                             f"{comp} line at stream {want.get('stream')} seq {want.get('seq')}"))
            continue
        out.append(Check(name, True, f"stream {stream} seq {seq}"))
    return out


def check_record(envelope: Any, pub: Ed25519PublicKey, *, rules_version: str | None = None,
                 event_files: list[Path] | None = None,
                 heads: Path | None = None) -> tuple[Record | None, list[Check]]:
    """The record (None when its signature fails) and every check made."""
    try:
        record = open_envelope(envelope, pub)
    except RecordError as e:
        return None, [Check("signature", False, str(e))]
    checks = [Check("signature", True, f"Ed25519 key {key_id(pub)}")]
    if rules_version is not None:
        have = (record.get("rules") or {}).get("version")
        checks.append(Check("rules", have == rules_version,
                            f"record {have}, rules directory {rules_version}"))
    if event_files:
        checks += check_chains(record, event_files)
        v = verify_files(event_files, {key_id(pub): pub}, heads)
        checks.append(Check("events", not v.findings, "the event files' chains are intact"
                            if not v.findings else "; ".join(str(f) for f in v.findings[:5])))
    return record, checks


def as_json(record: Record | None, checks: list[Check]) -> dict[str, Any]:
    return {"ok": all(c.ok for c in checks), "task_id": (record or {}).get("task_id"),
            "checks": [asdict(c) for c in checks]}
