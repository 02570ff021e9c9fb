"""The chain the writer adds to each line (stockade/events/chain.py, writer.py)."""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from stockade.events import EventWriter, make_event
from stockade.events.chain import GENESIS, ChainSigner, check_signature, digest, sig_payload
from stockade.events.chainkey import ChainError, key_id, load_or_create_key, load_public_key
from stockade.events.settings import EventSettings


def _event(i: int, **kw: object) -> dict:
    return make_event(component="gateway", action="connection_decision", decision="denied",
                      reason="no_matching_rule", destination_domain=f"h{i}.example",
                      destination_port=443, **kw)  # type: ignore[arg-type]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().splitlines()]


def _settings(tmp_path: Path, **kw: object) -> EventSettings:
    return EventSettings(chain_dir=str(tmp_path / "chain"), **kw)  # type: ignore[arg-type]


def test_each_line_carries_id_sequence_and_the_previous_lines_digest(tmp_path):
    path = tmp_path / "e.jsonl"
    w = _settings(tmp_path, checkpoint_every=1000).writer(path, None, False)
    for i in range(5):
        w.write(_event(i))
    raw = path.read_bytes().splitlines()
    evs = [json.loads(x) for x in raw]
    stream = w.chain.stream
    assert [e["event"]["sequence"] for e in evs] == [1, 2, 3, 4, 5]
    assert [e["event"]["id"] for e in evs] == [f"{stream}-{n}" for n in range(1, 6)]
    assert evs[0]["stockade"]["chain"] == {"stream": stream, "prev": GENESIS}
    for before, ev in zip(raw, evs[1:], strict=False):
        assert ev["stockade"]["chain"]["prev"] == digest(before)
    w.close()


def test_stamping_leaves_the_callers_nested_objects_alone(tmp_path):
    w = _settings(tmp_path).writer(tmp_path / "e.jsonl", None, False)
    ev = _event(1)
    inner_event, inner_stockade = ev["event"], ev["stockade"]
    w.write(ev)
    assert "sequence" not in inner_event and "chain" not in inner_stockade
    assert ev["event"]["sequence"] == 1  # the written (and subscribers') copy has them


def test_a_signed_checkpoint_follows_every_n_lines_and_close(tmp_path):
    path = tmp_path / "e.jsonl"
    w = _settings(tmp_path, checkpoint_every=3).writer(path, None, False)
    for i in range(7):
        w.write(_event(i))
    w.close()
    raw = path.read_bytes().splitlines()
    evs = [json.loads(x) for x in raw]
    cps = [(n, e) for n, e in enumerate(evs) if e["event"]["action"] == "chain_checkpoint"]
    # after lines 3 and 6 of the stream (the checkpoints count as lines), and at close
    assert [n for n, _ in cps] == [3, 7, 9]
    pub = load_public_key(tmp_path / "chain" / "signing.pub")
    for n, ev in cps:
        cp = ev["stockade"]["checkpoint"]
        assert ev["stockade"]["component"] == "gateway"
        assert cp["seq"] == evs[n - 1]["event"]["sequence"]
        assert cp["digest"] == digest(raw[n - 1])
        assert cp["key_id"] == key_id(pub)
        assert check_signature(pub, cp)
    head = json.loads((tmp_path / "chain" / "heads" / f"{w.chain.stream}.json").read_text())
    assert head["seq"] == cps[-1][1]["stockade"]["checkpoint"]["seq"]
    assert head["pid"] == os.getpid() and check_signature(pub, head)


def test_a_quiet_stream_gets_its_checkpoint_from_flush_due(tmp_path):
    now = [0.0]
    signer = ChainSigner(load_or_create_key(tmp_path / "c"), tmp_path / "c", every=1000,
                         interval_s=60.0, clock=lambda: now[0])
    path = tmp_path / "e.jsonl"
    w = EventWriter(path, chain=signer)
    w.write(_event(1))
    w.flush_due()
    assert len(_lines(path)) == 1
    now[0] = 61.0
    w.flush_due()
    assert [e["event"]["action"] for e in _lines(path)] == ["connection_decision",
                                                            "chain_checkpoint"]
    w.flush_due()  # nothing new since: no second checkpoint
    assert len(_lines(path)) == 2


def test_chain_false_keeps_id_and_sequence_only(tmp_path):
    path = tmp_path / "e.jsonl"
    w = _settings(tmp_path, chain=False, checkpoint_every=1).writer(path, None, False)
    w.write(_event(1))
    w.write(_event(2))
    w.close()
    evs = _lines(path)
    assert [e["event"]["sequence"] for e in evs] == [1, 2]
    assert all(set(e["stockade"]["chain"]) == {"stream"} for e in evs)
    assert not (tmp_path / "chain").exists()  # no key made, no checkpoints


def test_without_chain_dir_lines_are_linked_but_not_signed(tmp_path):
    path = tmp_path / "e.jsonl"
    w = EventSettings(checkpoint_every=1).writer(path, None, False)
    for i in range(3):
        w.write(_event(i))
    w.close()
    evs = _lines(path)
    assert [e["event"]["action"] for e in evs] == ["connection_decision"] * 3
    assert evs[2]["stockade"]["chain"]["prev"] == digest(path.read_bytes().splitlines()[1])


def test_a_bare_writer_writes_lines_as_before(tmp_path):
    path = tmp_path / "e.jsonl"
    w = EventWriter(path)
    ev = _event(1)
    w.write(ev)
    assert "sequence" not in ev["event"] and "chain" not in ev["stockade"]
    assert path.read_bytes() == w.encode(ev)


def test_a_stdout_failure_does_not_use_the_sequence_number_again(tmp_path, monkeypatch):
    path = tmp_path / "e.jsonl"
    w = _settings(tmp_path).writer(path, None, True)
    closed = open(os.devnull, "w")  # noqa: SIM115 - closed at once: writing to it fails
    closed.close()
    monkeypatch.setattr(sys, "stdout", closed)
    assert w.write(_event(1)) is False  # counted as lost: stdout did not get it
    monkeypatch.undo()
    assert w.write(_event(2)) is True
    w.close()
    evs = _lines(path)
    # the line stdout missed is in the file with seq 1; the loss note after it takes 2
    assert [(e["event"]["action"], e["event"]["sequence"]) for e in evs] == [
        ("connection_decision", 1), ("events_lost", 2), ("connection_decision", 3),
        ("chain_checkpoint", 4)]


def test_a_failed_file_write_takes_no_sequence_number(tmp_path):
    path = tmp_path / "e.jsonl"
    w = _settings(tmp_path).writer(path, None, False)
    w.write(_event(1))
    path.rename(tmp_path / "e.jsonl.1")
    path.mkdir()  # the reopen after this "rotation" fails, even for root
    w._checked = -1e9  # look for the rotation at the next write
    assert w.write(_event(2)) is False
    path.rmdir()
    assert w.write(_event(3)) is True
    w.close()
    evs = _lines(path)
    assert [(e["event"]["action"], e["event"]["sequence"]) for e in evs[:2]] == [
        ("events_lost", 2), ("connection_decision", 3)]
    assert evs[1]["destination"]["domain"] == "h3.example"


def test_summarised_events_use_no_sequence_number(tmp_path):
    path = tmp_path / "e.jsonl"
    w = _settings(tmp_path, verbatim_per_key=1).writer(path, None, False)
    for _ in range(5):
        w.write(_event(1, task_id="t1"))
    w.end_task("t1")
    w.close()
    evs = _lines(path)
    assert w.summarised == 4
    assert [e["event"]["sequence"] for e in evs] == list(range(1, len(evs) + 1))
    assert "event_summary" in {e["event"]["action"] for e in evs}


def test_the_key_is_made_once_with_private_permissions(tmp_path):
    d = tmp_path / "chain"
    k1 = load_or_create_key(d)
    k2 = load_or_create_key(d)
    assert key_id(k1.public_key()) == key_id(k2.public_key())
    assert (d / "signing.key").stat().st_mode & 0o777 == 0o600
    assert d.stat().st_mode & 0o777 == 0o700
    assert key_id(load_public_key(d / "signing.pub")) == key_id(k1.public_key())
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temporary files left


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_root_hands_the_key_to_the_directorys_owner(tmp_path):
    d = tmp_path / "chain"
    d.mkdir(mode=0o700)
    os.chown(d, 4242, 4243)
    load_or_create_key(d)
    for name in ("signing.key", "signing.pub", "heads"):
        st = (d / name).stat()
        assert (st.st_uid, st.st_gid) == (4242, 4243), name


def _make_key(d: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(key_id(load_or_create_key(d).public_key()))


def test_concurrent_first_writers_agree_on_one_key(tmp_path):
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_make_key, args=(str(tmp_path / "c"), q)) for _ in range(4)]
    for p in procs:
        p.start()
    ids = {q.get(timeout=60) for _ in procs}
    for p in procs:
        p.join()
    assert len(ids) == 1


def test_an_unusable_key_is_a_clear_error(tmp_path):
    d = tmp_path / "chain"
    d.mkdir()
    (d / "signing.key").write_text("not a key\n")
    with pytest.raises(ChainError, match=r"signing\.key: not an unencrypted PKCS8 PEM key"):
        load_or_create_key(d)
    with pytest.raises(ChainError, match="cannot read the public key"):
        load_public_key(d / "missing.pub")
    with pytest.raises(ChainError, match=r"signing\.key"):
        EventSettings(chain_dir=str(d)).chain_signer()


def test_the_signature_covers_stream_seq_and_digest():
    key = Ed25519PrivateKey.generate()
    cp = {"stream": "s", "seq": 3, "digest": "ab" * 32,
          "sig": base64.b64encode(key.sign(sig_payload("s", 3, "ab" * 32))).decode()}
    assert check_signature(key.public_key(), cp)
    for change in ({"seq": 4}, {"stream": "t"}, {"digest": "cd" * 32}, {"sig": "!!"}):
        assert not check_signature(key.public_key(), cp | change)


def test_chain_dir_follows_state_dir():
    from stockade.config import Config

    assert Config(state_dir="/srv/st").events.chain_dir == "/srv/st/events-chain"
    assert Config(events={"chain_dir": "/k"}).events.chain_dir == "/k"
    assert Config(state_dir="/s", events={"chain_dir": None}).events.chain_dir == \
        "/s/events-chain"
    assert Config().events.chain_dir == "/var/lib/stockade/events-chain"
