"""`stockade mcp` driven by the `mcp` package's own client over both transports (stdio,
streamable HTTP with a bearer token), in front of a real stack's launcher service: code
run in fresh and named sessions, files, exec, denials in the results, refusals as tool
errors, and the server's sessions killed when it stops."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamablehttp_client
from polling import eventually
from sessions_stack import Stack

from stockade.client import Client
from stockade.ports import free_port

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]

TOOLS = {"run_code", "exec", "create_session", "write_file", "read_file", "list_sessions",
         "kill"}



def _argv(stack: Stack, *extra: str) -> list[str]:
    return ["-m", "stockade", "mcp", "--launcher", stack.socket, "--profile", "e2e", *extra]


async def _call(s: ClientSession, tool: str, **args: Any) -> dict[str, Any]:
    res = await s.call_tool(tool, args)
    assert not res.isError, res.content
    assert res.structuredContent is not None
    out = res.structuredContent
    return out.get("result", out) if set(out) == {"result"} else out


async def _refused(s: ClientSession, tool: str, **args: Any) -> str:
    res = await s.call_tool(tool, args)
    assert res.isError, res
    return " ".join(getattr(c, "text", "") for c in res.content)


async def _exercise(s: ClientSession) -> str:
    """The tools, as an agent would use them; the named session's id."""
    await s.initialize()
    assert {t.name for t in (await s.list_tools()).tools} >= TOOLS
    fresh = await _call(s, "run_code", code="print(6 * 7)")
    assert (fresh["stdout"], fresh["exit_code"], fresh["session"]) == ("42\n", 0, None)
    shell = await _call(s, "run_code", code="echo hi > f.txt; echo oops >&2; exit 4",
                        language="shell", session="work")
    assert (shell["stderr"], shell["exit_code"], shell["session"]) == ("oops\n", 4, "work")
    assert (await _call(s, "read_file", session="work", path="f.txt"))["content"] == "hi\n"
    w = await _call(s, "write_file", session="work", path="t.py",
                    content="import sys; print(sys.stdin.read().upper())")
    assert w["size"] == 43
    ex = await _call(s, "exec", session="work", argv=["python3", "t.py"], stdin="abc")
    assert ex["stdout"] == "ABC\n" and ex["ended_by"] == "exit"
    denied = await _call(s, "run_code", session="work", language="shell",
                         code="getent hosts denied.test || echo refused")
    assert denied["stdout"] == "refused\n"
    assert any(d["reason"] == "no_matching_rule" and d["destination"] == "denied.test"
               and d["count"] >= 1 for d in denied["denials"]), denied
    rows = await _call(s, "list_sessions")
    work = next(r for r in rows if r["session_id"] == shell["session_id"])
    assert (work["name"], work["state"]) == ("work", "ready")
    assert work["labels"]["mcp_session"] == "work"
    assert "no session 'nope'" in await _refused(s, "exec", session="nope", argv=["true"])
    assert "path_refused" in await _refused(s, "read_file", session="work", path="../x")
    return str(work["session_id"])


def _ended(stack: Stack, sid: str) -> bool:
    with Client(stack.socket) as c:
        return c.get(sid).state == "ended"


@pytest.mark.timeout(300)
async def test_stdio(stack: Stack):
    params = StdioServerParameters(command=sys.executable, args=_argv(stack))
    async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
        sid = await _exercise(s)
        assert (await _call(s, "create_session", name="other"))["state"] == "ready"
        killed = await _call(s, "kill", session="other")
        assert killed["killed"] is True
        assert "no session 'other'" in await _refused(s, "exec", session="other",
                                                      argv=["true"])
        assert not _ended(stack, sid)
    assert eventually(lambda: _ended(stack, sid), 60)  # the server's sessions went with it



@asynccontextmanager
async def _http_server(stack: Stack, tmp: Path) -> AsyncIterator[tuple[str, str]]:
    token = secrets.token_urlsafe(24)
    (tmp / "mcp.token").write_text(token + "\n")
    port = free_port()
    err = tmp / "mcp.err"
    with open(err, "wb") as fh:
        proc = subprocess.Popen([sys.executable, *_argv(
            stack, "--transport", "http", "--port", str(port), "--token-file",
            str(tmp / "mcp.token"))], stdout=subprocess.DEVNULL, stderr=fh,
            stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        def up() -> bool:
            assert proc.poll() is None, err.read_text()
            try:
                return httpx.get(url, timeout=2).status_code == 401
            except httpx.HTTPError:
                return False

        assert eventually(up, 60), err.read_text()
        yield url, token
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.timeout(300)
async def test_streamable_http_with_token(stack: Stack, tmp_path: Path):
    async with _http_server(stack, tmp_path) as (url, token):
        wrong = httpx.post(url, json={}, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401 and json.loads(wrong.text)["error"] == "unauthorized"
        auth = {"Authorization": f"Bearer {token}"}
        async with streamablehttp_client(url, headers=auth) as (r, w, _), \
                ClientSession(r, w) as s:
            sid = await _exercise(s)
        assert not _ended(stack, sid)  # a client's leaving does not end the server's sessions
    assert _ended(stack, sid)  # the server's stop does


def test_http_off_loopback_needs_a_token(stack: Stack):
    proc = subprocess.run([sys.executable, *_argv(stack, "--transport", "http", "--host",
                                                  "0.0.0.0")],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 2 and "--token-file is required" in proc.stderr
