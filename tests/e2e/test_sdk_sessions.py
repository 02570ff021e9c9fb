"""The Python SDK (`stockade.client`), sync and asyncio, against a real stack's launcher
service: sessions created, used for many commands, streamed, fed stdin, given files,
suspended, killed on leaving the `with` block; refusals as the SDK's error classes; the
fence's denials in the exec's result."""

from __future__ import annotations

import asyncio

import pytest
from sessions_stack import Stack

from stockade.client import (
    AsyncSandbox,
    BadRequest,
    Client,
    NotFound,
    PathRefused,
    ProfileUnknown,
    Sandbox,
    SessionEnded,
)

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]

ORDER = ("import sys\n"
         "for i in range(3):\n"
         "    print('out', i, flush=True)\n"
         "    print('err', i, file=sys.stderr, flush=True)\n")



@pytest.mark.timeout(300)
def test_sync_session_lifecycle(stack: Stack):
    with Sandbox.create(profile="e2e", labels={"agent": "sdk-test"},
                        launcher=stack.socket) as sb:
        assert sb.info.state == "ready" and sb.info.labels == {"agent": "sdk-test"}
        sid = sb.id
        # state carries over between execs: one sandbox, one scratch
        assert sb.exec(["sh", "-c", "echo kept > note.txt"]).ok
        assert sb.exec(["cat", "note.txt"]).stdout == "kept\n"
        res = sb.exec(["python3", "-c", ORDER])
        assert (res.stdout, res.stderr) == ("out 0\nout 1\nout 2\n", "err 0\nerr 1\nerr 2\n")
        assert sb.exec(["cat"], stdin=b"\x00bytes\n").stdout == "\x00bytes\n"
        assert sb.exec(["sh", "-c", "exit 7"]).exit_code == 7
        assert sb.exec(["sleep", "30"], timeout_s=1).ended_by == "timeout"

        assert sb.files.write("src/app.py", "print('hi')\n").size == 12
        assert sb.files.read("src/app.py") == b"print('hi')\n"
        names = {e.name: e.type for e in sb.files.list()}
        assert names["src"] == "dir" and names["note.txt"] == "file"
        assert sb.exec(["python3", "app.py"], cwd="src").stdout == "hi\n"
        for bad in ("../etc/passwd", "/etc/passwd"):
            with pytest.raises(PathRefused):
                sb.files.read(bad)
        sb.exec(["ln", "-s", "/etc/passwd", "link"])
        with pytest.raises(PathRefused):
            sb.files.read("link")

        assert sb.suspend().state == "frozen"
        assert sb.resume().state == "ready"
        assert sb.extend(10**6).capped
    with Client(stack.socket) as c:
        assert c.get(sid).state == "ended"  # the with block killed it
        with pytest.raises(SessionEnded):
            c.exec(sid, ["true"])
        assert c.kill(sid) is True  # idempotent
        assert c.kill("0123456789") is False  # unknown


@pytest.mark.timeout(300)
def test_stream_arrives_while_the_command_runs(stack: Stack):
    """The first chunk reaches the SDK before the command can go on: it waits for a file
    that the test writes only after reading that chunk (no timing involved)."""
    wait = ("import os, sys, time\n"
            "print('ready', flush=True)\n"
            "while not os.path.exists('go'):\n"
            "    time.sleep(0.05)\n"
            "for i in range(3):\n"
            "    print('out', i, flush=True)\n"
            "    print('err', i, file=sys.stderr, flush=True)\n")
    with Sandbox.create(profile="e2e", launcher=stack.socket) as sb:
        stream = sb.exec(["python3", "-c", wait], stream=True, timeout_s=60)
        it = iter(stream)
        first = next(it)
        assert (first.type, first.data) == ("stdout", "ready\n")
        sb.files.write("go", "")
        rest = list(it)
        for kind, word in (("stdout", "out"), ("stderr", "err")):
            # each stream in the order the sandbox wrote it
            assert "".join(c.data for c in rest if c.type == kind) == "".join(
                f"{word} {i}\n" for i in range(3))
        assert stream.result.exit_code == 0 and stream.result.stdout == ""


@pytest.mark.timeout(300)
def test_kill_during_a_streamed_exec(stack: Stack):
    """The stream ends with the exec's end (`killed`), not with a transport error."""
    with Sandbox.create(profile="e2e", launcher=stack.socket) as sb:
        stream = sb.exec(["sh", "-c", "echo started; exec sleep 120"], stream=True)
        it = iter(stream)
        assert next(it).data == "started\n"
        with Client(stack.socket) as other:  # another orchestrator process, say
            assert other.kill(sb.id) is True
        assert list(it) == []
        assert stream.result.ended_by == "killed" and stream.result.exit_code != 0
        assert sb.kill() is True  # killing an ended session is no error (the block's exit)


@pytest.mark.timeout(300)
def test_refusals_carry_their_codes(stack: Stack):
    with Client(stack.socket) as c:
        with pytest.raises(ProfileUnknown) as ei:
            c.create("no-such-profile")
        assert ei.value.field == "profile"
        with pytest.raises(NotFound):
            c.get("0123456789")
        with pytest.raises(BadRequest) as ei:
            c.get("not-an-id")
        assert ei.value.field == "session_id"
        with Sandbox.create(profile="e2e", client=c) as sb, pytest.raises(BadRequest) as ei:
            sb.exec(["true"], timeout_s=-1)
        assert ei.value.field


@pytest.mark.timeout(300)
def test_denials_in_the_result(stack: Stack):
    with Sandbox.create(profile="e2e", labels={"run": "sdk-denial"},
                        launcher=stack.socket) as sb:
        res = sb.exec(["sh", "-c", "getent hosts denied.test || echo refused"])
        assert res.stdout == "refused\n"
        reasons = {(d["event"]["action"], d["event"]["reason"]) for d in res.denials}
        assert ("dns_decision", "no_matching_rule") in reasons, res.denials
        # the session's labels ride in every event of its task (the SOC's link to the run)
        assert all(d["labels"]["task_id"] == sb.id and d["labels"]["run"] == "sdk-denial"
                   for d in res.denials), res.denials
        assert sb.exec(["true"]).denials == []  # the next exec has its own


@pytest.mark.timeout(300)
async def test_async_sessions_and_concurrent_execs(stack: Stack):
    async with AsyncSandbox.create(profile="e2e", labels={"agent": "async"},
                                   launcher=stack.socket) as sb:
        results = await asyncio.gather(*(
            sb.exec(["sh", "-c", f"echo {i}; sleep 1; echo done {i}"]) for i in range(4)))
        assert [r.stdout for r in results] == [f"{i}\ndone {i}\n" for i in range(4)]
        await sb.files.write("data.bin", b"\x00\x01\x02")
        assert await sb.files.read("data.bin") == b"\x00\x01\x02"
        listing = {e.name: (e.type, e.size) for e in await sb.files.list()}
        assert listing["data.bin"] == ("file", 3)
        stream = await sb.exec(["python3", "-c", ORDER], stream=True)
        got = [c async for c in stream]
        assert "".join(c.data for c in got if c.type == "stderr") == "err 0\nerr 1\nerr 2\n"
        assert stream.result.ok
        assert any(s.session_id == sb.id for s in await sb.client.list())
        sid = sb.id
    sb2 = await AsyncSandbox.connect(sid, launcher=stack.socket)
    try:
        assert sb2.info.state == "ended"
    finally:
        await sb2.client.aclose()
