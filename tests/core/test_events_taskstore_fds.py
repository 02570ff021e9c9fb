"""The per-task store's kept descriptors (taskstore.OpenStores): one open per task, not
per event, and never a line written into a file that was unlinked meanwhile."""

from __future__ import annotations

import os
from pathlib import Path

from stockade.events import EventWriter, make_event
from stockade.events.taskstore import OpenStores, read_task_events


def test_lines_go_through_one_kept_descriptor(tmp_path: Path) -> None:
    stores = OpenStores()
    path = tmp_path / "t1.jsonl"
    stores.append(path, b'{"a":1}\n')
    fds = set(os.listdir("/proc/self/fd"))
    stores.append(path, b'{"a":2}\n')
    assert set(os.listdir("/proc/self/fd")) == fds  # no descriptor opened or closed
    assert path.read_bytes() == b'{"a":1}\n{"a":2}\n'
    stores.close()
    assert set(os.listdir("/proc/self/fd")) < fds


def test_an_unlinked_store_is_reopened_at_the_next_check(tmp_path: Path) -> None:
    stores = OpenStores(check_s=0.0)  # every append checks its descriptor
    path = tmp_path / "t1.jsonl"
    stores.append(path, b"old\n")
    path.unlink()  # what sweep does to a store past its retention
    stores.append(path, b"new\n")
    assert path.read_bytes() == b"new\n"
    stores.close()


def test_at_most_keep_descriptors_stay_open(tmp_path: Path) -> None:
    stores = OpenStores(keep=2)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        stores.append(tmp_path / f"t{i}.jsonl", b"x\n")
    assert len(os.listdir("/proc/self/fd")) == before + 2
    assert all((tmp_path / f"t{i}.jsonl").read_bytes() == b"x\n" for i in range(5))
    stores.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_writer_closes_a_tasks_store_at_its_end(tmp_path: Path) -> None:
    w = EventWriter(tmp_path / "events.jsonl", task_dir=tmp_path / "tasks")
    before = len(os.listdir("/proc/self/fd"))
    for n in range(3):
        w.write(make_event(component="gateway", action="connection_decision",
                           decision="allowed", reason="allowed", task_id="t1",
                           profile="p", source_ip="10.0.0.2", source_port=1000 + n))
    # the shared file's descriptor and the task store's
    assert len(os.listdir("/proc/self/fd")) == before + 2
    w.end_task("t1")
    assert len(os.listdir("/proc/self/fd")) == before + 1
    events = read_task_events(tmp_path / "tasks", "t1")
    ports = [e["source"]["port"] for e in events if e["event"]["action"] == "connection_decision"]
    assert ports == [1000, 1001, 1002]
    w.close()
    assert len(os.listdir("/proc/self/fd")) == before
