"""`stockade events --follow` across rotations: every line once, in order, even when the
writer rotates (once or many times) between two polls, or while the reader scans."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from stockade.events import EventWriter, make_event
from stockade.events.follow import lines


def _ev(n: int) -> dict:
    return make_event(
        component="gateway",
        action="connection_decision",
        decision="denied",
        reason="no_matching_rule",
        task_id=f"t{n}",
        destination_domain="evil.test",
        destination_port=443,
    )


def _task(line: str) -> str:
    return json.loads(line)["labels"]["task_id"]


class _Stop(Exception):
    """Raised by a test's sleep hook: the reader has had its chance to see every line."""


def _follow(path: Path, sleep: Callable[[float], None]) -> list[str]:
    """The task ids of the lines a follower yields until `sleep` raises _Stop."""
    seen: list[str] = []
    with pytest.raises(_Stop):
        for line in lines(path, follow=True, poll=0, sleep=sleep):
            seen.append(_task(line))
    return seen


def test_two_rotations_in_one_poll_lose_nothing(tmp_path: Path) -> None:
    """Before the fix the reader closed its old handle at the inode change: the line
    appended before the rename (now in .2) and all of .1 were never shown."""
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, max_bytes=1, backups=5)  # every write to a non-empty file rotates
    w.write(_ev(0))
    polls = []

    def sleep(_s: float) -> None:
        polls.append(1)
        if len(polls) == 1:
            w.write(_ev(1))  # rotates: t0 goes to .1, t1 is the new file
            w.write(_ev(2))  # rotates again: t0 in .2, t1 in .1
            w.write(_ev(3))
        elif len(polls) > 5:
            raise _Stop

    seen = _follow(path, sleep)
    w.close()
    assert seen == ["t0", "t1", "t2", "t3"]
    assert (tmp_path / "events.jsonl.3").exists()


def test_line_appended_to_the_renamed_file_is_read(tmp_path: Path) -> None:
    """Another writer keeps appending to the renamed file until it notices the rotation;
    the reader keeps the old handle draining, and a torn line waits for its end."""
    path = tmp_path / "events.jsonl"
    first = json.dumps(_ev(0)) + "\n"
    late = json.dumps(_ev(1)) + "\n"
    path.write_text(first)
    polls = []

    def sleep(_s: float) -> None:
        polls.append(1)
        if len(polls) == 1:
            with open(path, "a") as fh:  # half a line, then the rotation
                fh.write(late[:10])
            path.rename(tmp_path / "events.jsonl.1")
            path.write_text(json.dumps(_ev(2)) + "\n")
        elif len(polls) == 2:
            with open(tmp_path / "events.jsonl.1", "a") as fh:  # the slow writer
                fh.write(late[10:])
        elif len(polls) > 5:
            raise _Stop

    # t1 was whole only after t2 was there: it is shown when it is whole, not torn
    assert _follow(path, sleep) == ["t0", "t2", "t1"]


def test_file_moved_away_is_not_followed_into_old_backups(tmp_path: Path) -> None:
    """A file renamed by someone else (not a rotation) is not in the backups: the reader
    goes on with the new file and does not replay older backups as if they were newer."""
    path = tmp_path / "events.jsonl"
    (tmp_path / "events.jsonl.1").write_text(json.dumps(_ev(9)) + "\n")
    path.write_text(json.dumps(_ev(0)) + "\n")
    polls = []

    def sleep(_s: float) -> None:
        polls.append(1)
        if len(polls) == 1:
            path.rename(tmp_path / "archived.jsonl")
            path.write_text(json.dumps(_ev(1)) + "\n")
        elif len(polls) > 3:
            raise _Stop

    assert _follow(path, sleep) == ["t0", "t1"]


@pytest.mark.timeout(300)
def test_follow_races_a_rotating_writer(tmp_path: Path) -> None:
    """A writer thread rotates every few lines (max_bytes=2000) while the reader polls:
    every one of 2,000 lines is seen exactly once, in order."""
    total = 2000
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, max_bytes=2000, backups=50)
    events = [_ev(n) for n in range(total)]
    w.write(events[0])
    done = threading.Event()
    gate = threading.Event()

    def writer() -> None:
        gate.wait()
        for ev in events[1:]:
            w.write(ev)
            # a real pause between lines lets the reader poll amid the rotations
            done.wait(0.0002)
        done.set()

    seen: list[str] = []
    idle = [0, -1]  # polls without a new line since the writer finished, count at last poll

    def sleep(_s: float) -> None:
        gate.set()
        done.wait(0.001)
        if not done.is_set() or len(seen) != idle[1]:
            idle[:] = [0, len(seen)]
            return
        idle[0] += 1
        if idle[0] > 50:  # the writer is done and nothing more arrives: stop following
            raise _Stop

    t = threading.Thread(target=writer)
    t.start()
    try:
        with pytest.raises(_Stop):
            for line in lines(path, follow=True, poll=0, sleep=sleep):
                seen.append(_task(line))
    finally:
        gate.set()
        t.join()
        w.close()
    rotations = len(list(tmp_path.glob("events.jsonl.*")))
    assert rotations == 50, "the writer must have rotated through all its backups"
    assert seen == [f"t{n}" for n in range(total)]
