"""The signed task record (stockade/events/record.py, recordcheck.py) over event files
that real writers wrote: DSSE signing, the chain digests of the task's last lines, and
each kind of tampering."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from stockade.events import make_event
from stockade.events.chain import digest
from stockade.events.chainkey import load_or_create_key
from stockade.events.record import (
    PAYLOAD_TYPE,
    RecordError,
    last_lines,
    open_envelope,
    pae,
    sign,
)
from stockade.events.recordcheck import check_record
from stockade.events.settings import EventSettings


@pytest.fixture
def stream(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(events file, task store dir, chain dir) after a gateway and a launcher process
    wrote events of task t1 (and one of another task) to one file."""
    chain = tmp_path / "chain"
    settings = EventSettings(chain_dir=str(chain))
    events, tasks = tmp_path / "events.jsonl", tmp_path / "tasks"
    gw = settings.writer(events, tasks, stdout=False)
    la = settings.writer(events, tasks, stdout=False)
    for i in range(3):
        gw.write(make_event(component="gateway", action="connection_decision",
                            decision="denied", reason="no_matching_rule", task_id="t1",
                            destination_domain=f"d{i}.test"))
        gw.write(make_event(component="gateway", action="connection_decision",
                            decision="allowed", task_id="t2"))
    la.write(make_event(component="launcher", action="sandbox_lifecycle", task_id="t1",
                        extra={"lifecycle": "end", "ended_by": "exit"}))
    gw.close()
    la.close()
    return events, tasks, chain


def _record(tasks: Path) -> dict:
    return {"version": 1, "task_id": "t1", "rules": {"version": "v1"}, "ended_by": "exit",
            "chains": last_lines(tasks, "t1")}


def test_pae_is_dsse_v1() -> None:
    assert pae("t", b"hello") == b"DSSEv1 1 t 5 hello"


def test_a_record_verifies_against_its_events(stream: tuple[Path, Path, Path]) -> None:
    events, tasks, chain = stream
    key = load_or_create_key(chain)
    rec = _record(tasks)
    assert set(rec["chains"]) == {"gateway", "launcher"}
    assert rec["chains"]["gateway"]["seq"] == 5  # its third t1 line, t2's between
    env = sign(rec, key)
    assert env["payloadType"] == PAYLOAD_TYPE and open_envelope(env, key.public_key()) == rec
    got, checks = check_record(env, key.public_key(), rules_version="v1",
                               event_files=[events], heads=chain / "heads")
    assert got == rec and all(c.ok for c in checks), [str(c) for c in checks]
    assert [c.name for c in checks] == ["signature", "rules", "chain:gateway",
                                        "chain:launcher", "events"]


def test_an_edited_field_fails_the_signature(stream: tuple[Path, Path, Path]) -> None:
    _, tasks, chain = stream
    key = load_or_create_key(chain)
    env = sign(_record(tasks), key)
    edited = json.loads(base64.b64decode(env["payload"]))
    edited["ended_by"] = "ttl"
    env["payload"] = base64.b64encode(json.dumps(edited).encode()).decode()
    record, checks = check_record(env, key.public_key())
    assert record is None and [c.name for c in checks] == ["signature"]
    assert "does not verify" in checks[0].text


def test_another_key_or_no_envelope_fails(stream: tuple[Path, Path, Path]) -> None:
    _, tasks, chain = stream
    env = sign(_record(tasks), load_or_create_key(chain))
    with pytest.raises(RecordError, match="no signature by key"):
        open_envelope(env, Ed25519PrivateKey.generate().public_key())
    with pytest.raises(RecordError, match="payloadType"):
        open_envelope({"payload": env["payload"]}, load_or_create_key(chain).public_key())
    with pytest.raises(RecordError, match="malformed"):
        open_envelope({**env, "signatures": [{"keyid": "x"}]},
                      load_or_create_key(chain).public_key())


def test_a_swapped_rule_hash_fails(stream: tuple[Path, Path, Path]) -> None:
    _, tasks, chain = stream
    key = load_or_create_key(chain)
    # re-signed by the host key with another hash: the signature holds, the rules do not
    env = sign({**_record(tasks), "rules": {"version": "v2"}}, key)
    _, checks = check_record(env, key.public_key(), rules_version="v1")
    assert [(c.name, c.ok) for c in checks] == [("signature", True), ("rules", False)]


def _without(events: Path, out: Path, pick: str) -> Path:
    lines = events.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(ln for ln in lines if digest(ln) != pick))
    return out


def test_a_removed_event_fails(stream: tuple[Path, Path, Path], tmp_path: Path) -> None:
    events, tasks, chain = stream
    key = load_or_create_key(chain)
    rec = _record(tasks)
    env = sign(rec, key)
    # the task's last gateway line (the one the record names)
    cut = _without(events, tmp_path / "a.jsonl", rec["chains"]["gateway"]["digest"])
    _, checks = check_record(env, key.public_key(), event_files=[cut])
    # (the writer's closing checkpoint followed it: the stream's chain is broken too)
    assert {c.name for c in checks if not c.ok} == {"chain:gateway", "events"}
    # an earlier line of the task: the stream's chain breaks
    mine = [digest(ln) for ln in events.read_bytes().splitlines()
            if json.loads(ln).get("labels", {}).get("task_id") == "t1"]
    cut = _without(events, tmp_path / "b.jsonl", mine[1])
    _, checks = check_record(env, key.public_key(), event_files=[cut])
    assert {c.name for c in checks if not c.ok} == {"events"}


def test_a_digest_of_another_task_s_line_fails(stream: tuple[Path, Path, Path]) -> None:
    events, tasks, chain = stream
    key = load_or_create_key(chain)
    rec = _record(tasks)
    other = next(ln for ln in events.read_bytes().splitlines()
                 if json.loads(ln).get("labels", {}).get("task_id") == "t2")
    rec["chains"]["gateway"] = {**rec["chains"]["gateway"], "digest": digest(other)}
    _, checks = check_record(sign(rec, key), key.public_key(), event_files=[events])
    bad = [c for c in checks if not c.ok]
    assert [c.name for c in bad] == ["chain:gateway"] and "not the task's" in bad[0].text


def test_the_cli_verifies_and_refuses_clearly(stream: tuple[Path, Path, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from stockade.cli import main

    events, tasks, chain = stream
    env = sign(_record(tasks), load_or_create_key(chain))
    path = tmp_path / "stockade-record.json"
    path.write_text(json.dumps(env))
    pub = str(chain / "signing.pub")
    assert main(["task", "verify", str(path), "--key", pub, "--events", str(events)]) == 0
    assert "task t1: verified" in capsys.readouterr().out
    # the record as its event carries it (stockade.record) verifies the same
    (tmp_path / "event.json").write_text(json.dumps({"stockade": {"record": env}}))
    assert main(["task", "verify", str(tmp_path / "event.json"), "--key", pub]) == 0
    capsys.readouterr()
    assert main(["task", "verify", str(path), "--key", str(tmp_path / "nope.pub")]) == 2
    assert "cannot read the public key" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("{not json")
    assert main(["task", "verify", str(tmp_path / "junk.json"), "--key", pub]) == 2
    assert "stockade task verify:" in capsys.readouterr().err
    assert main(["task", "verify", str(path), "--key", pub, "--rules",
                 str(tmp_path / "no-rules")]) == 2
    assert "--rules" in capsys.readouterr().err
