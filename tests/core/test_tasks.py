import asyncio
import os
import stat

import pytest

from stockade.tasks import (
    ControlClient,
    ControlError,
    RegistryError,
    Task,
    TaskRegistry,
    make_control_app,
    start_control_server,
)


def test_lookup_by_address_and_mapped_form():
    r = TaskRegistry()
    r.register(Task("t1", "10.213.0.2", "p"))
    assert r.by_address("10.213.0.2").task_id == "t1"
    assert r.by_address("::ffff:10.213.0.2").task_id == "t1"
    assert r.by_address("10.213.0.3") is None
    assert r.by_address("not an ip") is None


def test_address_belongs_to_one_task():
    r = TaskRegistry()
    r.register(Task("t1", "10.213.0.2", "p"))
    with pytest.raises(RegistryError):
        r.register(Task("t2", "10.213.0.2", "p"))
    # re-registering the same task at a new address moves it
    r.register(Task("t1", "10.213.0.6", "p"))
    assert r.by_address("10.213.0.2") is None
    assert r.by_address("10.213.0.6").task_id == "t1"


def test_expiry_and_removal_listeners():
    r = TaskRegistry()
    removed = []
    r.on_removed(removed.append)
    r.register(Task("t1", "10.0.0.1", "p", expires_at=100.0))
    r.register(Task("t2", "10.0.0.2", "p"))
    assert r.by_address("10.0.0.1", now=50.0) is not None
    assert [t.task_id for t in r.expire(now=100.0)] == ["t1"]
    assert [t.task_id for t in removed] == ["t1"]
    assert r.deregister("t2").task_id == "t2"
    assert [t.task_id for t in removed] == ["t1", "t2"]
    assert r.deregister("t2") is None


def test_persisted_across_restart(tmp_path):
    state = tmp_path / "state" / "registry.json"
    r = TaskRegistry(state)
    r.register(Task("t1", "10.0.0.1", "p"))
    r.register(Task("t2", "10.0.0.2", "q", expires_at=1.0))  # already expired
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o600
    r2 = TaskRegistry(state)
    assert [t.task_id for t in r2.tasks()] == ["t1"]
    assert r2.by_address("10.0.0.1").profile == "p"


def test_corrupt_state_is_an_error_not_an_empty_registry(tmp_path):
    state = tmp_path / "registry.json"
    state.write_text("{not json")
    with pytest.raises(RegistryError):
        TaskRegistry(state)


@pytest.mark.parametrize(
    "bad",
    [
        {"task_id": "t", "address": "nope", "profile": "p"},
        {"task_id": "", "address": "10.0.0.1", "profile": "p"},
        {"task_id": "t\n", "address": "10.0.0.1", "profile": "p"},
        {"address": "10.0.0.1", "profile": "p"},
        {"task_id": "t", "address": "10.0.0.1", "profile": "p", "expires_at": "soon"},
    ],
)
def test_invalid_tasks_rejected(bad):
    with pytest.raises(RegistryError):
        Task.from_dict(bad)


async def test_control_api_over_unix_socket(tmp_path):
    reg = TaskRegistry()
    reloads = []

    async def reload():
        reloads.append(1)
        return {"ok": True, "version": "v2"}

    sock = tmp_path / "run" / "control.sock"
    runner = await start_control_server(make_control_app(reg, reload=reload), sock)
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        client = ControlClient(sock)

        def calls():
            client.register(Task("t1", "10.0.0.9", "p", expires_at=None))
            assert [t.task_id for t in client.list()] == ["t1"]
            assert client.health()["tasks"] == 1
            assert client.reload()["version"] == "v2"
            with pytest.raises(ControlError) as e:
                client._call(
                    "POST", "/v1/tasks", {"task_id": "x", "address": "bad", "profile": "p"}
                )
            assert e.value.status == 400
            with pytest.raises(ControlError):
                client.register(Task("t2", "10.0.0.9", "p"))  # address taken
            client.deregister("t1")
            assert client.deregister("t1") is None  # idempotent
            with pytest.raises(ControlError):
                client.deregister("t1", missing_ok=False)

        await asyncio.to_thread(calls)
        assert reg.by_address("10.0.0.9") is None
        assert reloads == [1]
    finally:
        await runner.cleanup()
