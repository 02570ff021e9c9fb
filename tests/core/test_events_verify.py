"""`stockade events verify` (stockade/events/verify.py) against real writers' files: two
streams in one rotating file, then each kind of tampering."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from stockade.events import make_event, schema, writer
from stockade.events.settings import EventSettings
from stockade.events.verify import main, order_files

EVENTS = 3000


def _event(i: int) -> dict:
    return make_event(component="gateway" if i % 2 else "broker", action="connection_decision",
                      decision="denied", reason="no_matching_rule",
                      destination_domain=f"h{i}.example", destination_port=443,
                      message=f"event number {i:05d}")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3,000 events from two writers (two streams) sharing one file, rotated >= 3 times."""
    d = tmp_path_factory.mktemp("written")
    settings = EventSettings(chain_dir=str(d / "chain"), checkpoint_every=100,
                             max_bytes=150_000, backups=30)
    with pytest.MonkeyPatch.context() as mp:
        # each writer sees the other's rotation at once, as two processes do after
        # ROTATION_CHECK_S: both streams then share every file
        mp.setattr(writer, "ROTATION_CHECK_S", 0.0)
        a = settings.writer(d / "events.jsonl", None, False)
        b = settings.writer(d / "events.jsonl", None, False)
        for i in range(EVENTS):
            (a if i % 2 else b).write(_event(i))
        a.close()
        b.close()
    return d


@pytest.fixture
def logs(written: Path, tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    shutil.copytree(written, d)
    return d


def _files(d: Path) -> list[Path]:
    return [p for p, _ in order_files(sorted(d.glob("events.jsonl*")))]


def _verify(d: Path, capsys: pytest.CaptureFixture[str], *extra: str,
            key: Path | None = None) -> tuple[int, dict]:
    argv = [*map(str, _files(d)), "--key", str(key or d / "chain" / "signing.pub"),
            "--heads", str(d / "chain" / "heads"), "--json", *extra]
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


def _kinds(result: dict) -> list[str]:
    return [f["kind"] for f in result["findings"]]


def _rows(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _stream_of(line: bytes) -> str:
    return json.loads(line)["stockade"]["chain"]["stream"]


def _next_of_stream(rows: list[bytes], i: int) -> int:
    s = _stream_of(rows[i])
    return next(j for j in range(i + 1, len(rows)) if _stream_of(rows[j]) == s)


def _middle(d: Path) -> tuple[Path, list[bytes], int]:
    """A middle file, its lines, and the index of a plain event in its middle."""
    path = _files(d)[1]
    rows = _rows(path)
    i = len(rows) // 2
    while b"chain_checkpoint" in rows[i] or b"chain_checkpoint" in rows[_next_of_stream(rows, i)]:
        i += 1
    return path, rows, i


def test_clean_files_verify_with_two_streams_and_rotations(logs, capsys):
    files = _files(logs)
    assert len(files) >= 4  # at least three rotations
    checker = jsonschema.Draft202012Validator(schema())
    rc, result = _verify(logs, capsys)
    assert rc == 0, result["findings"]
    assert result["ok"] and not result["findings"]
    assert len(result["streams"]) == 2
    assert sum(s["lines"] for s in result["streams"].values()) == result["lines"]
    assert result["lines"] >= EVENTS + EVENTS // 100  # the events and their checkpoints
    for s in result["streams"].values():
        assert s["first_seq"] == 1 and s["signed_seq"] == s["last_seq"] - 1
    for f in files:
        assert len({_stream_of(r) for r in _rows(f)}) == 2  # both streams in each file
        for r in _rows(f):  # the chain fields and checkpoints are in the schema
            checker.validate(json.loads(r))


def test_text_output_and_exit_codes(logs, capsys):
    argv = [*map(str, _files(logs)), "--key", str(logs / "chain" / "signing.pub"),
            "--heads", str(logs / "chain" / "heads")]
    assert main(argv) == 0
    assert "2 stream(s), 0 broken: intact" in capsys.readouterr().out
    assert main([str(logs / "nope.jsonl"), "--key", str(logs / "chain" / "signing.pub")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert main([str(_files(logs)[0])]) == 2
    assert "--key" in capsys.readouterr().err


def test_an_edited_byte_is_reported_at_the_streams_next_line(logs, capsys):
    path, rows, i = _middle(logs)
    rows[i] = rows[i].replace(b"event number", b"event numbex")
    path.write_bytes(b"".join(rows))
    rc, result = _verify(logs, capsys)
    assert rc == 1
    assert _kinds(result) == ["edit"]
    assert result["findings"][0]["where"] == f"{path}:{_next_of_stream(rows, i) + 1}"
    assert result["findings"][0]["stream"] == _stream_of(rows[i])


def test_a_deleted_line_is_a_gap(logs, capsys):
    path, rows, i = _middle(logs)
    nxt = _next_of_stream(rows, i)
    del rows[i]
    path.write_bytes(b"".join(rows))
    rc, result = _verify(logs, capsys)
    assert rc == 1 and _kinds(result) == ["gap"]
    assert result["findings"][0]["where"] == f"{path}:{nxt}"  # the next line moved up one


def test_two_swapped_lines_are_a_reorder(logs, capsys):
    path, rows, i = _middle(logs)
    j = _next_of_stream(rows, i)
    rows[i], rows[j] = rows[j], rows[i]
    path.write_bytes(b"".join(rows))
    rc, result = _verify(logs, capsys)
    assert rc == 1 and _kinds(result) == ["reorder"]


def test_a_truncated_newest_file_is_caught_by_the_heads(logs, capsys):
    newest = _files(logs)[-1]
    rows = _rows(newest)
    newest.write_bytes(b"".join(rows[:-3]))
    rc, result = _verify(logs, capsys)
    assert rc == 1 and "truncation" in _kinds(result)
    assert all(f["where"].endswith(".json") for f in result["findings"])
    # without the heads the cut is not seen: the documented limit
    argv = [*map(str, _files(logs)), "--key", str(logs / "chain" / "signing.pub"), "--json"]
    assert main(argv) == 0
    assert "truncation not checked" in capsys.readouterr().out


def test_a_deleted_rotation_is_a_gap_across_files(logs, capsys):
    files = _files(logs)
    gone = logs / "events.jsonl.2"
    assert gone in files
    gone.unlink()
    rc, result = _verify(logs, capsys)
    assert rc == 1 and _kinds(result) == ["gap", "gap"]  # each stream jumps over the file
    assert all(f["where"].startswith(f"{logs / 'events.jsonl.1'}:") for f in result["findings"])


def test_deleting_the_oldest_rotation_is_only_a_note(logs, capsys):
    _files(logs)[0].unlink()  # as rotation does with the oldest file
    rc, result = _verify(logs, capsys)
    assert rc == 0, result["findings"]
    assert {n["kind"] for n in result["notes"]} == {"start"}


def _quiet_stream_files(d: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A busy stream rotating the file and a quiet one that wrote once before: its seq 1
    is in a file that rotation removes."""
    monkeypatch.setattr(writer, "ROTATION_CHECK_S", 0.0)
    settings = EventSettings(chain_dir=str(d / "chain"), checkpoint_every=10,
                             max_bytes=20_000, backups=2)
    quiet = settings.writer(d / "events.jsonl", None, False)
    quiet.write(_event(0))
    busy = settings.writer(d / "events.jsonl", None, False)
    for i in range(300):
        busy.write(_event(i))
    quiet.write(_event(1))
    quiet.close()
    busy.close()
    return d / "chain" / "signing.pub", d / "chain" / "heads"


def test_a_quiet_stream_whose_start_rotated_away_is_a_note(tmp_path, monkeypatch, capsys):
    pub, heads = _quiet_stream_files(tmp_path, monkeypatch)
    files = _files(tmp_path)
    assert main([*map(str, files), "--key", str(pub), "--heads", str(heads), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "start" in {n["kind"] for n in result["notes"]}
    # without its head nothing says the process is older than these files: a gap
    for h in heads.iterdir():
        h.unlink()
    assert main([*map(str, files), "--key", str(pub), "--json"]) == 1
    assert _kinds(json.loads(capsys.readouterr().out)) == ["gap"]


def test_a_flipped_signature_bit_is_a_bad_checkpoint(logs, capsys):
    path, rows, _ = _middle(logs)
    i = next(n for n, r in enumerate(rows) if b"chain_checkpoint" in r)
    ev = json.loads(rows[i])
    sig = bytearray(base64.b64decode(ev["stockade"]["checkpoint"]["sig"]))
    sig[5] ^= 1
    old = ev["stockade"]["checkpoint"]["sig"].encode()
    rows[i] = rows[i].replace(old, base64.b64encode(bytes(sig)))
    path.write_bytes(b"".join(rows))
    rc, result = _verify(logs, capsys)
    assert rc == 1 and _kinds(result) == ["checkpoint"]
    assert "signature does not verify" in result["findings"][0]["text"]
    assert result["findings"][0]["where"] == f"{path}:{i + 1}"


def test_a_wrong_key_is_an_unknown_key(logs, capsys, tmp_path):
    other = tmp_path / "other.pub"
    other.write_bytes(Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    rc, result = _verify(logs, capsys, key=other)
    assert rc == 1 and set(_kinds(result)) == {"checkpoint"}
    assert all("unknown key" in f["text"] for f in result["findings"])


def test_a_torn_last_line_is_a_note_not_an_edit(logs, capsys):
    newest = _files(logs)[-1]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) - 40])  # a crash in the middle of the last line
    rc, result = _verify(logs, capsys)
    assert rc == 0, result["findings"]
    assert [n["kind"] for n in result["notes"]] == ["torn"]


def test_an_inserted_line_without_chain_fields_is_an_edit(logs, capsys):
    path, rows, i = _middle(logs)
    rows.insert(i, json.dumps(_event(99)).encode() + b"\n")
    path.write_bytes(b"".join(rows))
    rc, result = _verify(logs, capsys)
    assert rc == 1 and _kinds(result) == ["edit"]
    assert "no chain fields" in result["findings"][0]["text"]


def test_a_forged_head_is_reported(logs, capsys):
    head = next((logs / "chain" / "heads").glob("*.json"))
    doc = json.loads(head.read_text())
    head.write_text(json.dumps(doc | {"seq": doc["seq"] + 50}))
    rc, result = _verify(logs, capsys)
    assert rc == 1 and _kinds(result) == ["checkpoint"]
    assert "head signature does not verify" in result["findings"][0]["text"]


def test_rotated_names_sort_oldest_first():
    names = [Path("e.jsonl"), Path("other.log"), Path("e.jsonl.1"), Path("e.jsonl.10"),
             Path("e.jsonl.2")]
    assert [(p.name, oldest) for p, oldest in order_files(names)] == [
        ("e.jsonl.10", True), ("e.jsonl.2", False), ("e.jsonl.1", False), ("e.jsonl", False),
        ("other.log", True)]


def test_without_files_it_reads_the_configured_file_and_rotations(logs, capsys, tmp_path):
    import argparse

    from stockade.cli import config_or_fail
    from stockade.events.verify import add_arguments, run

    cfg = tmp_path / "stockade.yaml"
    cfg.write_text(f"events: {{file: {logs / 'events.jsonl'}, chain_dir: {logs / 'chain'}}}\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--json"])
    args.config, args.config_loader = str(cfg), config_or_fail
    assert run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and len(result["streams"]) == 2
    assert result["lines"] == sum(len(_rows(f)) for f in _files(logs))


def test_the_module_runs_on_its_own(logs):
    out = subprocess.run(
        [sys.executable, "-m", "stockade.events.verify", *map(str, _files(logs)),
         "--key", str(logs / "chain" / "signing.pub"), "--heads", str(logs / "chain" / "heads")],
        capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("intact")
