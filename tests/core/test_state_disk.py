"""A full state disk (a real tmpfs, filled up): the task registry changes memory only after
its state file was written, the control API answers a JSON 507 naming the problem, and
background loops survive their errors (stockade/loops.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from polling import async_wait_until

from stockade.loops import ErrorLog, every
from stockade.tasks import (
    ControlClient,
    ControlError,
    StateWriteError,
    Task,
    TaskRegistry,
    make_control_app,
    start_control_server,
)

FullDisk = Any  # tests/conftest.py's FullDisk (the `full_disk` fixture makes them)


def _state(path: Path) -> str:
    return path.read_text()


def test_registration_on_a_full_disk_changes_nothing(full_disk: Callable[[str], FullDisk]) -> None:
    disk = full_disk("state")
    path = disk.path / "gateway-tasks.json"
    r = TaskRegistry(path)
    r.register(Task("t1", "10.0.0.1", "p"))
    before = _state(path)
    disk.fill()
    with pytest.raises(StateWriteError) as e:
        r.register(Task("t2", "10.0.0.2", "p"))
    assert str(e.value) == "[Errno 28] state_write_failed: No space left on device"
    # memory and disk agree: neither has t2, and t1 stays in both
    assert r.get("t2") is None and r.by_address("10.0.0.2") is None and len(r) == 1
    with pytest.raises(StateWriteError):
        r.register(Task("t1", "10.0.0.9", "p"))  # a move is refused whole, too
    assert r.by_address("10.0.0.1").task_id == "t1" and r.by_address("10.0.0.9") is None
    with pytest.raises(StateWriteError):
        r.deregister("t1")
    assert r.get("t1") is not None
    assert _state(path) == before
    # no tmp file left behind
    assert sorted(p.name for p in disk.path.iterdir()) == [".filler", "gateway-tasks.json"]
    disk.free()
    r.register(Task("t2", "10.0.0.2", "p"))
    assert {t.task_id for t in TaskRegistry(path).tasks()} == {"t1", "t2"}


def test_expiry_on_a_full_disk_ends_the_task_once(full_disk: Callable[[str], FullDisk]) -> None:
    disk = full_disk("state")
    path = disk.path / "tasks.json"
    r = TaskRegistry(path)
    ended: list[str] = []
    r.on_removed(lambda t: ended.append(t.task_id))
    r.register(Task("old", "10.0.0.1", "p", expires_at=100.0))
    r.register(Task("live", "10.0.0.2", "p"))
    disk.fill()
    # expired: never answers as a task, its flows are closed (listeners) once
    assert r.by_address("10.0.0.1", now=200.0) is None
    for _ in range(3):
        with pytest.raises(StateWriteError):
            r.expire(now=200.0)
    assert ended == ["old"]
    # the record stays in memory and on disk until a save works
    assert r.get("old") is not None and "old" in _state(path)
    disk.free()
    assert [t.task_id for t in r.expire(now=200.0)] == ["old"]
    assert ended == ["old"] and r.get("old") is None and "old" not in _state(path)


async def test_control_api_answers_507_and_keeps_no_task(
    full_disk: Callable[[str], FullDisk], tmp_path: Path
) -> None:
    disk = full_disk("state")
    registry = TaskRegistry(disk.path / "tasks.json")
    registry.register(Task("t1", "10.0.0.1", "p"))
    runner = await start_control_server(make_control_app(registry), tmp_path / "c.sock")
    client = ControlClient(tmp_path / "c.sock")
    try:
        disk.fill()
        with pytest.raises(ControlError) as e:
            await asyncio.to_thread(client.register, Task("t2", "10.0.0.2", "p"))
        assert e.value.status == 507
        assert e.value.body == {"error": "state_write_failed",
                                "detail": "state_write_failed: No space left on device"}
        assert e.value.describe() == "507 state_write_failed: No space left on device"
        assert registry.get("t2") is None
        with pytest.raises(ControlError) as e:
            await asyncio.to_thread(client.deregister, "t1")
        assert e.value.status == 507 and registry.get("t1") is not None
        disk.free()
        await asyncio.to_thread(client.register, Task("t2", "10.0.0.2", "p"))
        assert [t.task_id for t in await asyncio.to_thread(client.list)] == ["t1", "t2"]
    finally:
        await runner.cleanup()


# -- loops that survive ------------------------------------------------------------------------
def test_error_log_first_then_once_per_period() -> None:
    e = ErrorLog(repeat_s=60)
    assert e.failed(0.0) == ("first", 1)
    assert [e.failed(t) for t in (1.0, 30.0, 59.0)] == [None, None, None]
    assert e.failed(61.0) == ("again", 4)
    assert e.failed(62.0) is None
    assert e.succeeded() is True and e.succeeded() is False
    assert e.failed(100.0) == ("first", 1)


async def test_every_survives_a_failing_step(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    calls: list[int] = []
    done = asyncio.Event()

    async def step() -> None:
        calls.append(len(calls))
        if len(calls) <= 3:
            raise OSError(28, "No space left on device")
        if len(calls) == 5:
            done.set()

    loop = asyncio.create_task(every(0.01, step, "test: expiry", logging.getLogger("t")))
    try:
        await asyncio.wait_for(done.wait(), 30)
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
    lines = [r.getMessage() for r in caplog.records if r.name == "t"]
    assert lines == ["test: expiry failed (will retry): [Errno 28] No space left on device",
                     "test: expiry works again"]


async def test_broker_expiry_loop_survives_a_full_disk(
    full_disk: Callable[[str], FullDisk],
) -> None:
    from stockade.broker.service import BrokerService

    from stockade.config import Config

    disk = full_disk("state")
    svc = BrokerService(Config())
    svc.registry = TaskRegistry(disk.path / "broker-tasks.json")
    svc.registry.register(Task("t1", "10.0.0.1", "p", expires_at=time.time() + 0.2))
    disk.fill()
    loop = asyncio.create_task(svc._expire_loop())
    try:
        await asyncio.sleep(1.5)  # several failed rounds (0.5 s each)
        assert not loop.done() and svc.registry.get("t1") is not None
        disk.free()
        await async_wait_until(lambda: svc.registry.get("t1") is None, 10, 0.1)
        assert svc.registry.get("t1") is None
        assert "t1" not in _state(disk.path / "broker-tasks.json")
    finally:
        loop.cancel()
