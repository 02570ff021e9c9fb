"""A session leaves the signed task record a one-shot run leaves: written when its sandbox
ends (DELETE, its TTL), in the event stream, answered by `GET /v1/sessions/{id}/record`
and verified by `stockade task verify` against the real event file."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stockade.events import read_events

from . import sessions_rig
from .sessions_rig import Rig

rig = sessions_rig.rig

pytestmark = pytest.mark.netns


def _payload(envelope: dict[str, Any]) -> dict[str, Any]:
    return dict(json.loads(base64.b64decode(envelope["payload"])))


def _lifecycle(rig: Rig, sid: str) -> dict[str, dict[str, Any]]:
    return {e["stockade"]["lifecycle"]: e for e in read_events(rig.config.events_file)
            if e.get("labels", {}).get("task_id") == sid
            and e["event"]["action"] == "sandbox_lifecycle"}


def _verify(rig: Rig, path: Path) -> tuple[int, dict[str, Any]]:
    chain = Path(str(rig.config.events.chain_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "stockade", "task", "verify", str(path), "--json",
         "--key", str(chain / "signing.pub"), "--rules", rig.config.rules_dir,
         "--events", str(rig.config.events_file)],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_a_killed_session_has_a_verifiable_record(rig: Rig, tmp_path: Path) -> None:
    sid = rig.api.create("svc", labels={"agent": "tester"})["session_id"]
    running = rig.api.call("GET", f"/v1/sessions/{sid}/record")
    assert running.status == 409 and running.json()["error"] == "session_running"
    assert rig.api.exec(sid, ["true"])["exit_code"] == 0
    rig.api.kill(sid)
    got = rig.api.call("GET", f"/v1/sessions/{sid}/record")  # waits for the teardown
    assert got.status == 200, got.body
    envelope = got.json()
    record = _payload(envelope)
    assert record["task_id"] == sid and record["ended_by"] == "killed", record
    assert record["profile"] == "svc" and record["rules"]["version"] is not None
    # the caller's labels, beside the task's own two, as its events carry them
    assert record["labels"] == {"agent": "tester", "task_id": sid, "profile": "svc"}, record
    assert envelope["signatures"], envelope
    events = _lifecycle(rig, sid)
    assert events["end"]["stockade"]["ended_by"] == "killed"
    assert events["record"]["stockade"]["record"] == envelope  # the stream has it too
    path = tmp_path / "stockade-record.json"
    path.write_text(json.dumps(envelope))
    code, out = _verify(rig, path)
    assert code == 0 and out["ok"], out
    record["ended_by"] = "exit"  # an edited field no longer verifies
    path.write_text(json.dumps({**envelope, "payload": base64.b64encode(
        json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).decode()}))
    code, out = _verify(rig, path)
    assert code == 1 and not out["ok"], out


def test_an_expired_session_ends_by_ttl(rig: Rig) -> None:
    sid = rig.api.create("svc-short", ttl_s=1)["session_id"]
    deadline = time.time() + 60
    while time.time() < deadline:
        if rig.api.call("GET", f"/v1/sessions/{sid}").json()["state"] == "ended":
            break
        time.sleep(0.2)
    got = rig.api.call("GET", f"/v1/sessions/{sid}/record")
    assert got.status == 200, got.body
    assert _payload(got.json())["ended_by"] == "ttl"
    end = _lifecycle(rig, sid)["end"]
    assert end["stockade"]["ended_by"] == "ttl" and end["event"]["reason"] == "ttl_expired"


def test_record_of_an_unknown_session(rig: Rig) -> None:
    assert rig.api.call("GET", "/v1/sessions/0123456789/record").status == 404
    assert rig.api.call("GET", "/v1/sessions/nope/record").status == 400
