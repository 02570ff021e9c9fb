"""A full log disk (a real 64 KiB tmpfs): the events file holds whole lines only, every
lost event is counted, the loss is logged and reported by an `events_lost` event once
writing works again."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.events import EventWriter, make_event, taskstore, validate


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _event(i: int) -> dict[str, object]:
    # ~ 1000 bytes, so lines straddle the tmpfs's 4 KiB pages and writes come up short
    return make_event(component="gateway", action="connection_decision", decision="denied",
                      reason="no_matching_rule", task_id="t1", destination_port=i % 65535,
                      message="x" * (900 + i % 7))


def test_full_disk_leaves_whole_lines_and_reports_the_loss(
        small_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 16384)
    path = small_disk / "events.jsonl"
    w = EventWriter(path)
    caplog.set_level(logging.WARNING, logger="stockade.events")
    results = [w.write(_event(i)) for i in range(200)]
    failed = results.count(False)
    assert failed > 100  # the disk filled up part-way
    assert w.dropped == failed
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # ends on a whole line
    events = [json.loads(line) for line in lines[:-1]]  # not one torn or merged line
    for ev in events:
        validate(ev)
    notes = [e for e in events if e["event"]["action"] == "events_lost"]
    assert len(events) - len(notes) == results.count(True)
    assert any("could not be written" in r.getMessage() for r in caplog.records)
    # room again: the next write works, after an event that says what was lost
    filler.unlink()
    assert w.write(_event(999))
    events = [json.loads(x) for x in path.read_bytes().splitlines()]
    lost, last = events[-2:]
    validate(lost)
    assert lost["event"]["action"] == "events_lost"
    assert last["stockade"]["component"] == "gateway" and last["destination"]["port"] == 999
    # every lost event is in exactly one report
    assert sum(e["stockade"]["lost"] for e in events
               if e["event"]["action"] == "events_lost") == failed
    assert lost["stockade"]["lost_total"] == failed
    with contextlib.suppress(OSError):
        os.unlink(path)


def test_a_short_write_is_cut_back_without_cutting_another_writers_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process appending between our short write and the cut-back: its line
    must survive whole and our fragment must not merge with it."""
    path = tmp_path / "events.jsonl"
    mine = json.dumps({"n": 1, "pad": "x" * 500}).encode() + b"\n"
    theirs = json.dumps({"n": 2}).encode() + b"\n"
    real_write = os.write
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    other = threading.Thread(target=taskstore.append, args=(path, theirs))

    def short_write(f: int, data: bytes) -> int:
        if f != fd:
            return real_write(f, data)
        n = real_write(f, data[:100])  # the disk filled up part-way through the line
        other.start()  # its own open file description, like another component's
        other.join(2.0)  # with the lock it waits for us; without, it appends right here
        return n

    monkeypatch.setattr(os, "write", short_write)
    with pytest.raises(OSError):
        taskstore.append_line(fd, mine)
    os.close(fd)
    other.join()
    assert [json.loads(line) for line in path.read_bytes().splitlines()] == [{"n": 2}]
