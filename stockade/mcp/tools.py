"""What the MCP tools do, on the asyncio SDK: sessions by name, code and commands run in
them, files in and out, results an agent can read (stdout, stderr, exit code, denials
counted by reason and destination). No MCP types here: `server.py` wraps these.

A session is named by the agent (`"work"`) or by its id; the names live in this process.
A `run_code` without a session gets a fresh sandbox that is killed right after; the
sessions this server created are killed when it stops (`close`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Literal

from pydantic import BaseModel, Field

from stockade.client import (
    AsyncClient,
    BadRequest,
    ExecResult,
    NotFound,
    StockadeError,
    summarize_denials,
)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
LABEL_KEY = "mcp_session"  # the session's name, in its events' labels too


class ToolFailure(Exception):
    """A refusal an agent should read (`server.py` turns it into an MCP tool error)."""


class Denial(BaseModel):
    reason: str
    destination: str
    count: int


class ExecOutput(BaseModel):
    session: str | None = Field(description="the session's name; null: a fresh sandbox, "
                                            "already killed")
    session_id: str
    exit_code: int | None
    ended_by: str = Field(description="exit, timeout, killed or limit")
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0
    denials: list[Denial] = Field(default_factory=list,
                                  description="what the fence refused during this run")


class SessionRow(BaseModel):
    name: str | None
    session_id: str
    profile: str
    isolation: str
    state: str
    expires_at: float
    execs_running: int
    labels: dict[str, str]


def output_of(res: ExecResult, name: str | None, session_id: str) -> ExecOutput:
    return ExecOutput(
        session=name, session_id=session_id, exit_code=res.exit_code, ended_by=res.ended_by,
        stdout=res.stdout, stderr=res.stderr, stdout_truncated=res.stdout_truncated,
        stderr_truncated=res.stderr_truncated, duration_s=res.duration_s,
        denials=[Denial(reason=r, destination=d, count=n)
                 for r, d, n in summarize_denials(res.denials)])


def code_argv(code: str, language: Literal["python", "shell"]) -> list[str]:
    if language == "python":
        return ["python3", "-c", code]
    if language == "shell":
        return ["sh", "-c", code]
    raise ToolFailure(f"language must be python or shell, not {language!r}")


class SessionTools:
    def __init__(self, client: AsyncClient, *, profile: str | None = None,
                 ttl_s: int | None = None) -> None:
        self.client = client
        self.profile = profile  # for sessions the agent does not name a profile for
        self.ttl_s = ttl_s
        self._names: dict[str, str] = {}  # name -> session id (created here)
        self._lock = asyncio.Lock()  # two calls naming one new session create it once

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except StockadeError as e:
            raise ToolFailure(str(e)) from None

    async def _create(self, name: str | None, profile: str | None,
                      labels: dict[str, str] | None) -> str:
        profile = profile or self.profile
        if not profile:
            raise ToolFailure("no profile: pass `profile`, or start `stockade mcp --profile`")
        tags = {"created_by": "stockade-mcp", **(labels or {})}
        if name is not None:
            tags[LABEL_KEY] = name
        info = await self._call(self.client.create(profile, labels=tags, ttl_s=self.ttl_s))
        return str(info.session_id)

    async def resolve(self, session: str) -> str:
        """The id of a session named here, or `session` itself when it is a live id."""
        if session in self._names:
            return self._names[session]
        try:
            return str((await self.client.get(session)).session_id)
        except (NotFound, BadRequest):  # BadRequest: not even the shape of an id
            raise ToolFailure(f"no session {session!r}: create it with create_session "
                              "or run_code") from None
        except StockadeError as e:
            raise ToolFailure(str(e)) from None

    async def create_session(self, name: str, profile: str | None = None,
                             labels: dict[str, str] | None = None) -> SessionRow:
        if not NAME_RE.match(name):
            raise ToolFailure("name: 1-64 letters, digits, '_', '.', '-'")
        async with self._lock:
            if name in self._names:
                raise ToolFailure(f"session {name!r} exists; kill it first")
            self._names[name] = await self._create(name, profile, labels)
        return self._row(await self._call(self.client.get(self._names[name])))

    async def run_code(self, code: str, language: Literal["python", "shell"] = "python",
                       session: str | None = None, profile: str | None = None,
                       timeout_s: float | None = None) -> ExecOutput:
        argv = code_argv(code, language)
        if session is not None:
            async with self._lock:
                if session not in self._names and NAME_RE.match(session):
                    try:
                        await self.client.get(session)  # an id given as the name
                    except (NotFound, BadRequest):
                        self._names[session] = await self._create(session, profile, None)
            return await self.exec(session, argv, timeout_s=timeout_s)
        sid = await self._create(None, profile, None)
        try:
            res = await self._call(self.client.exec(sid, argv, timeout_s=timeout_s))
        finally:
            await self.client.kill(sid)
        return output_of(res, None, sid)

    async def exec(self, session: str, argv: list[str], stdin: str | None = None,
                   cwd: str | None = None, timeout_s: float | None = None) -> ExecOutput:
        if not argv:
            raise ToolFailure("argv: at least the program to run")
        sid = await self.resolve(session)
        res = await self._call(self.client.exec(sid, argv, stdin=stdin, cwd=cwd,
                                                timeout_s=timeout_s))
        return output_of(res, self._name_of(sid), sid)

    async def write_file(self, session: str, path: str, content: str) -> dict[str, Any]:
        sid = await self.resolve(session)
        w = await self._call(self.client.write_file(sid, path, content))
        return {"path": w.path, "size": w.size}

    async def read_file(self, session: str, path: str) -> dict[str, Any]:
        sid = await self.resolve(session)
        data: bytes = await self._call(self.client.read_file(sid, path))
        text = data.decode("utf-8", "replace")
        return {"path": path, "size": len(data), "content": text,
                "binary": text.encode() != data}

    async def list_sessions(self) -> list[SessionRow]:
        return [self._row(i) for i in await self._call(self.client.list())]

    async def kill(self, session: str) -> dict[str, Any]:
        sid = await self.resolve(session)
        killed = await self._call(self.client.kill(sid))
        self._forget(sid)
        return {"session_id": sid, "killed": killed}

    async def close(self) -> None:
        """Kill the sessions this server created (an agent that left does not leave
        sandboxes running until their TTL)."""
        for sid in list(self._names.values()):
            try:
                await self.client.kill(sid)
            except StockadeError:
                continue  # unreachable launcher: the TTL still ends them
        self._names.clear()

    def _name_of(self, sid: str) -> str | None:
        return next((n for n, s in self._names.items() if s == sid), None)

    def _forget(self, sid: str) -> None:
        for n in [n for n, s in self._names.items() if s == sid]:
            del self._names[n]

    def _row(self, info: Any) -> SessionRow:
        return SessionRow(name=self._name_of(info.session_id) or info.labels.get(LABEL_KEY),
                          session_id=info.session_id, profile=info.profile,
                          isolation=info.isolation, state=info.state,
                          expires_at=info.expires_at, execs_running=info.execs_running,
                          labels=info.labels)
