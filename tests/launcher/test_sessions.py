"""Sessions over the launcher's control service: many commands in one sandbox, streamed,
on the container and the gVisor tier (`tier`), against the real launcher."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from stockade.launcher.execspec import ExecSpec
from stockade.launcher.spec import LauncherError

from . import sessions_rig
from .conftest import Lab
from .sessions_rig import Rig

# the rig's fixtures, shared with the other session test modules
rig, stier, session = sessions_rig.rig, sessions_rig.stier, sessions_rig.session

pytestmark = pytest.mark.netns


def test_create_shape(rig: Rig, stier: str) -> None:
    s = rig.api.create(stier, ttl_s=30, labels={"run.id": "r-1"})
    try:
        assert s["state"] == "ready" and s["profile"] == stier
        assert s["labels"] == {"run.id": "r-1"} and s["execs_running"] == 0
        assert 29 <= s["expires_at"] - s["created_at"] <= 30
        got = rig.api.call("GET", f"/v1/sessions/{s['session_id']}").json()
        assert got["session_id"] == s["session_id"]
        ids = [x["session_id"] for x in rig.api.call("GET", "/v1/sessions").json()["sessions"]]
        assert s["session_id"] in ids
    finally:
        rig.api.kill(s["session_id"])
    assert rig.api.call("GET", f"/v1/sessions/{s['session_id']}").json()["state"] == "ended"


def test_exec_runs_as_the_first_command(rig: Rig, session: str) -> None:
    r = rig.api.exec(session, ["sh", "-c", "id -u; pwd; echo $FOO; cat; echo err >&2; exit 3"],
                     env={"FOO": "bar"}, stdin="piped\n")
    assert r["exit_code"] == 3 and r["ended_by"] == "exit", r
    assert r["stdout"].splitlines() == ["65534", "/scratch", "bar", "piped"]
    assert r["stderr"] == "err\n"
    # state carries over between execs: the same scratch
    rig.api.exec(session, ["sh", "-c", "mkdir -p sub && echo kept > sub/f"])
    r = rig.api.exec(session, ["cat", "f"], cwd="sub")
    assert r["stdout"] == "kept\n"


def test_streaming_order(rig: Rig, session: str) -> None:
    got = list(rig.api.stream(f"/v1/sessions/{session}/exec", {"argv": [
        "sh", "-c", "for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; sleep 0.05; done"]}))
    assert got[-1]["type"] == "exit" and got[-1]["exit_code"] == 0
    out = "".join(x["data"] for x in got if x["type"] == "stdout")
    err = "".join(x["data"] for x in got if x["type"] == "stderr")
    assert out == "".join(f"out{i}\n" for i in range(1, 6))
    assert err == "".join(f"err{i}\n" for i in range(1, 6))
    assert sum(1 for x in got if x["type"] == "exit") == 1


def test_stream_arrives_while_running(rig: Rig, session: str) -> None:
    it = rig.api.stream(f"/v1/sessions/{session}/exec",
                        {"argv": ["sh", "-c", "echo first; sleep 1; echo second"]})
    first = next(it)
    assert first == {"type": "stdout", "data": "first\n"}
    rest = list(it)
    assert rest[0] == {"type": "stdout", "data": "second\n"} and rest[-1]["type"] == "exit"


def test_concurrent_execs(rig: Rig, session: str) -> None:
    results: dict[int, dict] = {}

    def one(i: int) -> None:
        results[i] = rig.api.exec(session, ["sh", "-c", f"sleep 0.3; echo {i}"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {i: r["stdout"] for i, r in results.items()} == {i: f"{i}\n" for i in range(6)}


def test_timeout(rig: Rig, session: str) -> None:
    r = rig.api.exec(session, ["sleep", "30"], timeout_s=0.5)
    assert r["ended_by"] == "timeout" and r["exit_code"] == 137, r
    assert r["duration_s"] < 30


def test_kill_during_exec(rig: Rig, stier: str) -> None:
    sid = rig.api.create(stier)["session_id"]
    it = rig.api.stream(f"/v1/sessions/{sid}/exec", {"argv": ["sh", "-c", "echo up; sleep 60"]})
    assert next(it)["data"] == "up\n"
    rig.api.kill(sid)
    last = list(it)[-1]
    assert last["type"] == "exit" and last["ended_by"] == "killed", last
    a = rig.api.call("POST", f"/v1/sessions/{sid}/exec", {"argv": ["true"]})
    assert a.status == 409 and a.json()["error"] == "session_ended"


def test_output_cap_and_invalid_utf8(rig: Rig, session: str) -> None:
    r = rig.api.exec(session, ["sh", "-c", "printf '\\377ok\\n'; head -c 200000 /dev/zero"])
    assert r["stdout"].startswith("\ufffdok\n")
    assert r["stdout_truncated"] and not r["stderr_truncated"]


def test_output_is_scrubbed(rig: Rig, session: str) -> None:
    ip = rig.svc.launcher._live[session].record.host_ip
    r = rig.api.exec(session, ["sh", "-c", f"echo at {ip} now"])
    assert ip not in r["stdout"] and "<infra-address>" in r["stdout"]


def test_ttl_expiry_and_cap(rig: Rig) -> None:
    s = rig.api.create("svc-short", ttl_s=1)
    ext = rig.api.call("POST", f"/v1/sessions/{s['session_id']}/ttl", {"ttl_s": 60}).json()
    assert ext["capped"] and ext["expires_at"] <= s["created_at"] + 3.001
    deadline = time.time() + 30
    while time.time() < deadline:
        got = rig.api.call("GET", f"/v1/sessions/{s['session_id']}").json()
        if got["state"] == "ended":
            break
        time.sleep(0.2)
    assert got["state"] == "ended"


def test_suspend_resume(rig: Rig) -> None:
    sid = rig.api.create("svc")["session_id"]
    try:
        assert rig.api.call("POST", f"/v1/sessions/{sid}/suspend").json()["state"] == "frozen"
        a = rig.api.call("POST", f"/v1/sessions/{sid}/exec", {"argv": ["true"]})
        assert a.status == 409 and a.json()["error"] == "busy"
        assert rig.api.call("POST", f"/v1/sessions/{sid}/resume").json()["state"] == "ready"
        assert rig.api.exec(sid, ["true"])["exit_code"] == 0
    finally:
        rig.api.kill(sid)


@pytest.mark.parametrize(("body", "code", "field"), [
    ({"profile": "nope"}, "profile_unknown", "profile"),
    ({"profile": "vm"}, "launcher_error", "profile"),
    ({}, "bad_request", "profile"),
    ({"profile": "svc", "ttl_s": 0}, "bad_request", "ttl_s"),
    ({"profile": "svc", "labels": {"Bad": "x"}}, "bad_request", "labels"),
    ({"profile": "svc", "labels": {"task_id": "x"}}, "bad_request", "labels"),
    ({"profile": "svc", "env": {"STOCKADE_X": "1"}}, "bad_request", "env"),
    ({"profile": "svc", "inputs": [{"host": "/nonexistent-x", "guest": "/in/x"}]},
     "bad_request", "inputs.0.host"),
    ({"profile": "svc", "extra": 1}, "bad_request", "extra"),
])
def test_create_refusals(rig: Rig, body: dict, code: str, field: str) -> None:
    before = len(rig.svc.launcher.list())
    a = rig.api.call("POST", "/v1/sessions", body)
    assert a.status == 400 and a.json()["error"] == code and a.json()["field"] == field, a.body
    assert len(rig.svc.launcher.list()) == before  # nothing half-created


def test_exec_refusals(rig: Rig, session: str) -> None:
    for body, field in [({"argv": []}, "argv"), ({"argv": ["true"], "cwd": "../x"}, "cwd"),
                        ({"argv": ["true"], "stdin": "a", "stdin_b64": "YQ=="}, "stdin"),
                        ({"argv": ["true"], "timeout_s": -1}, "timeout_s")]:
        a = rig.api.call("POST", f"/v1/sessions/{session}/exec", body)
        assert a.status == 400 and a.json()["field"] == field, a.body
    assert rig.api.call("POST", "/v1/sessions/0123456789/exec",
                        {"argv": ["true"]}).status == 404


def test_one_shot_runs_unchanged(rig: Rig, tmp_path: Path) -> None:
    a = rig.api.call("POST", "/v1/sandboxes", {"profile": "svc", "argv": ["echo", "hi"]})
    assert a.status == 200 and a.json()["stdout"] == "hi\n" and a.json()["exit_code"] == 0


def test_labels_in_the_registration(rig: Rig, lab: Lab) -> None:
    s = rig.api.create("svc", labels={"user": "alice", "agent": "a-1"})
    try:
        for reg in (lab.gateway_registry, lab.broker_registry):
            task = reg.get(s["session_id"])
            assert task is not None and task.labels == {"user": "alice", "agent": "a-1"}
    finally:
        rig.api.kill(s["session_id"])


def test_server_sent_events(rig: Rig, session: str) -> None:
    a = rig.api.call("POST", f"/v1/sessions/{session}/exec",
                     {"argv": ["sh", "-c", "echo one; echo two >&2"]},
                     headers={"Accept": "text/event-stream"})
    assert a.status == 200 and a.headers["Content-Type"].startswith("text/event-stream")
    events = [blk.split("\n") for blk in a.body.decode().strip().split("\n\n")]
    kinds = [e[0].removeprefix("event: ") for e in events]
    assert kinds[-1] == "exit" and set(kinds[:-1]) == {"stdout", "stderr"}
    datas = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert {d["type"]: d.get("data") for d in datas[:-1]} == {"stdout": "one\n",
                                                               "stderr": "two\n"}
    assert datas[-1]["exit_code"] == 0


def test_one_shot_sandboxes_take_no_exec(rig: Rig) -> None:
    a = rig.api.call("POST", "/v1/sandboxes", {"profile": "svc", "argv": ["sleep", "30"],
                                               "wait": False})
    tid = a.json()["task_id"]
    try:
        with pytest.raises(LauncherError):
            rig.svc.launcher.exec(tid, ExecSpec(("true",)))
        assert rig.api.call("POST", f"/v1/sessions/{tid}/exec",
                            {"argv": ["true"]}).status == 404
    finally:
        rig.api.call("DELETE", f"/v1/sandboxes/{tid}")


def test_exec_server_restarts(rig: Rig) -> None:
    """The container tier's exec server killed (an OOM kill would do it): its running
    exec ends, the next exec starts a new server."""
    sid = rig.api.create("svc")["session_id"]
    try:
        assert rig.api.exec(sid, ["true"])["exit_code"] == 0
        server = rig.svc.launcher._live[sid].pipes
        it = rig.api.stream(f"/v1/sessions/{sid}/exec", {"argv": ["sh", "-c", "echo up; sleep 60"]})
        assert next(it)["data"] == "up\n"
        server.proc.kill()
        assert list(it)[-1]["exit_code"] == 137
        assert rig.api.exec(sid, ["echo", "again"])["stdout"] == "again\n"
        assert rig.svc.launcher._live[sid].pipes is not server
    finally:
        rig.api.kill(sid)
