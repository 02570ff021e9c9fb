"""The task store read from a mark (`store_size`): only the events written after it, a
mark inside a line starting at the next whole line, a missing store read as empty."""

from __future__ import annotations

import json
from pathlib import Path

from stockade.events import taskstore


def _line(n: int) -> bytes:
    return json.dumps({"n": n, "text": "x" * n}).encode() + b"\n"


def test_read_from_a_mark(tmp_path: Path) -> None:
    path = taskstore.task_file(tmp_path, "0123456789")
    assert path is not None
    assert taskstore.store_size(tmp_path, "0123456789") == 0  # no store yet
    assert taskstore.read_task_events(tmp_path, "0123456789", 5) == []
    for n in range(3):
        taskstore.append(path, _line(n))
    mark = taskstore.store_size(tmp_path, "0123456789")
    assert mark == path.stat().st_size
    for n in range(3, 5):
        taskstore.append(path, _line(n))
    assert [e["n"] for e in taskstore.read_task_events(tmp_path, "0123456789")] == [0, 1, 2, 3, 4]
    assert [e["n"] for e in taskstore.read_task_events(tmp_path, "0123456789", mark)] == [3, 4]
    # a mark inside line 3 (e.g. one taken while another writer's line was half written)
    assert [e["n"] for e in taskstore.read_task_events(tmp_path, "0123456789",
                                                       mark + 3)] == [4]
    end = taskstore.store_size(tmp_path, "0123456789")
    assert taskstore.read_task_events(tmp_path, "0123456789", end) == []
    assert taskstore.store_size(tmp_path, "../x") == 0  # not a task id: no file
