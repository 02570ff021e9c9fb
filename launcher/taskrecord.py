"""The task record a sandbox leaves when it ends (the fields; stockade/events/record.py
signs it and docs/task-record.md describes it): who ran what under which rules and tier,
what the fence self-test saw, how it ended, what it did (flows, DNS answers, broker calls
and bypass attempts, the self-test's own probes left out) and, per component, the last
line of the task's event chain."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from stockade.events import make_event, timestamp
from stockade.events.chainkey import ChainError, load_or_create_key
from stockade.events.record import PAYLOAD_TYPE, RECORD_FILE, canonical, last_lines, sign
from stockade.events.taskstore import read_task_events

from . import vmimage
from .selftest import Report, without_probe_events
from .state import SandboxRecord

Event = dict[str, Any]
log = logging.getLogger("stockade.launcher")
# (component, action) -> the count it is in
_COUNTED = {("gateway", "connection_decision"): "flows", ("gateway", "request_decision"):
            "requests", ("dns", "dns_decision"): "dns", ("broker", "broker_call"): "broker_calls",
            ("launcher", "bypass_attempt"): "bypass_attempts"}


def counts(events: list[Event]) -> dict[str, dict[str, int]]:
    """Allowed and denied per kind, from the task's store (summaries count their events)."""
    out = {k: {"allowed": 0, "denied": 0} for k in _COUNTED.values()}
    for ev in without_probe_events(events):
        st, action = ev.get("stockade") or {}, (ev.get("event") or {}).get("action")
        n = 1
        if action == "event_summary":
            summary = st.get("summary") or {}
            action, n = summary.get("action"), int(summary.get("count", 0))
        kind = _COUNTED.get((st.get("component"), action))
        decision = st.get("decision")
        if kind is not None and decision in ("allowed", "denied"):
            out[kind][decision] += n
    return out


@functools.lru_cache(maxsize=16)
def _sha256(path: str, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: str) -> str | None:
    try:
        return _sha256(path, os.stat(path).st_mtime_ns)
    except OSError:
        return None


@functools.lru_cache(maxsize=4)
def runsc_version(runsc: str) -> str | None:
    path = shutil.which(runsc)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def backend_details(isolation: dict[str, Any], s: Any) -> dict[str, Any]:
    """The tier and what it ran on: the host kernel; the microVM's kernel and initramfs
    digests; runsc's version, platform and network."""
    out: dict[str, Any] = {**isolation, "host_kernel": os.uname().release}
    tier = isolation.get("isolation")
    if tier == "microvm":
        try:
            img = vmimage.load_image(s.microvm.image_dir)
        except ValueError as e:
            out["image_error"] = str(e)
        else:
            out.update(kernel_sha256=file_digest(img.kernel),
                       initrd_sha256=file_digest(img.initrd), image_stamp=img.stamp)
    elif tier == "gvisor":
        out["runsc_version"] = runsc_version(s.gvisor.runsc)
    return out


def limits_of(limits: Any, ttl: float) -> dict[str, Any]:
    fields = ("cpus", "memory", "disk", "pids", "egress_bytes")
    return {**{f: getattr(limits, f, None) for f in fields}, "ttl_s": ttl}


def build(rec: SandboxRecord, *, policy_version: str | None, isolation: dict[str, Any],
          limits: dict[str, Any], selftest: Report | None, ended_by: str,
          exit_code: int | None, ended_at: float, events: list[Event],
          chains: dict[str, dict[str, Any]], labels: dict[str, str]) -> dict[str, Any]:
    """The record's fields; `labels` are the caller's, kept under the task's own two as
    its events carry them (stockade/events/writer.py:label_with)."""
    return {
        "version": 1, "task_id": rec.task_id,
        "labels": {**labels, "task_id": rec.task_id, "profile": rec.profile},
        "profile": rec.profile, "rules": {"version": policy_version},
        "isolation": isolation, "limits": limits,
        "selftest": selftest.as_dict() if selftest is not None else {"skipped": "not run"},
        "started": timestamp(rec.started_at), "ended": timestamp(ended_at),
        "ended_by": ended_by, "exit_code": exit_code, "counts": counts(events),
        "chains": chains,
    }


class Recorder:
    """Signs each ended task's record with the event chain's key, writes it to the event
    stream (`sandbox_lifecycle`, `stockade.lifecycle = record`) and to the run's export
    directory as `stockade-record.json`."""

    def __init__(self, config: Any, emit: Callable[[Event], None]) -> None:
        self.s = config.launcher
        self.chain_dir = config.events.chain_dir
        self.task_events_dir = Path(config.task_events_dir)
        self.emit = emit

    def _key(self) -> Ed25519PrivateKey | None:
        if not self.chain_dir:
            return None
        try:
            return load_or_create_key(self.chain_dir)
        except ChainError as e:  # the record is still written, unsigned: verify says so
            log.warning("launcher: task record left unsigned: %s", e)
            return None

    def write(self, rec: SandboxRecord, *, export_dir: str | None, **fields: Any) -> Event:
        """The envelope of `rec`'s record (`fields`: build's keyword arguments but the
        store's events and chains, read here)."""
        events = read_task_events(self.task_events_dir, rec.task_id)
        record = build(rec, ended_at=time.time(), events=events,
                       chains=last_lines(self.task_events_dir, rec.task_id), **fields)
        key = self._key()
        envelope = sign(record, key) if key is not None else {
            "payloadType": PAYLOAD_TYPE,
            "payload": base64.b64encode(canonical(record)).decode(), "signatures": []}
        self.emit(make_event(
            component="launcher", action="sandbox_lifecycle", task_id=rec.task_id,
            profile=rec.profile, policy_version=fields.get("policy_version"),
            source_ip=rec.guest_ip, message="task record (signed)" if key else
            "task record (unsigned: no signing key)",
            extra={"lifecycle": "record", "record": envelope}))
        if export_dir is not None:
            path = Path(export_dir) / RECORD_FILE
            try:
                path.write_text(json.dumps(envelope, indent=1) + "\n")
            except OSError as e:
                log.warning("launcher: cannot write %s: %s", path, e)
        return envelope
