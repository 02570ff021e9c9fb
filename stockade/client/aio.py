"""The asyncio SDK: `AsyncClient` and `AsyncSandbox`, the same calls as the synchronous
ones (`sync.py`), awaited.

    async with AsyncSandbox.create(profile="python") as sb:
        async for chunk in await sb.exec(["python3", "-u", "train.py"], stream=True):
            print(chunk.data, end="")
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, Literal, overload

import httpx
from httpx_sse import EventSource

from . import wire
from .errors import NotFound, SessionEnded
from .models import ExecResult, FileEntry, Output, SessionInfo, TaskRecord, Written
from .records import PublicKey, task_record
from .transport import Endpoint, mapped_errors, request_kwargs, timeout_of


class AsyncClient:
    """`Client`'s calls over an httpx.AsyncClient (same `target` and keywords)."""

    def __init__(self, target: str | None = None, *, endpoint: Endpoint | None = None,
                 **kw: Any) -> None:
        self.endpoint = endpoint or Endpoint.resolve(target, **kw)
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(**self.endpoint.transport_kwargs()),
            **self.endpoint.client_kwargs())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def send(self, call: wire.Call) -> tuple[int, bytes]:
        with mapped_errors(self.endpoint):
            r = await self._http.request(call.method, call.path,
                                         timeout=timeout_of(self.endpoint, call),
                                         **request_kwargs(call))
            return r.status_code, r.content

    def open_stream(self, call: wire.Call) -> contextlib.AbstractAsyncContextManager[
            httpx.Response]:
        return self._http.stream(call.method, call.path, timeout=timeout_of(self.endpoint, call),
                                 **request_kwargs(call))

    # -- sessions ----------------------------------------------------------------------------
    async def create(self, profile: str, **kw: Any) -> SessionInfo:
        return wire.session(*await self.send(wire.create(profile, **kw)))

    async def get(self, session_id: str) -> SessionInfo:
        return wire.session(*await self.send(wire.get(session_id)))

    async def list(self) -> list[SessionInfo]:
        return wire.sessions(*await self.send(wire.list_sessions()))

    async def kill(self, session_id: str) -> bool:
        try:
            wire.as_json(*await self.send(wire.kill(session_id)))
        except (NotFound, SessionEnded):
            return False
        return True

    async def suspend(self, session_id: str) -> SessionInfo:
        return wire.session(*await self.send(wire.op(session_id, "suspend")))

    async def resume(self, session_id: str) -> SessionInfo:
        return wire.session(*await self.send(wire.op(session_id, "resume")))

    async def extend(self, session_id: str, ttl_s: int) -> SessionInfo:
        return wire.session(*await self.send(wire.extend(session_id, ttl_s)))

    async def record(self, session_id: str, public_key: PublicKey | None = None
                     ) -> TaskRecord:
        return task_record(*await self.send(wire.record(session_id)), public_key)

    # -- exec --------------------------------------------------------------------------------
    async def exec(self, session_id: str, argv: list[str], **kw: Any) -> ExecResult:
        stream = self.exec_stream(session_id, argv, keep=True, **kw)
        async for _ in stream:
            pass
        return stream.result

    def exec_stream(self, session_id: str, argv: list[str], *, keep: bool = False,
                    **kw: Any) -> AsyncExecStream:
        return AsyncExecStream(self, wire.exec_call(session_id, argv, **kw), keep=keep)

    # -- files -------------------------------------------------------------------------------
    async def write_file(self, session_id: str, path: str, data: bytes | str) -> Written:
        return wire.written(*await self.send(wire.write_file(session_id, path, data)))

    async def read_file(self, session_id: str, path: str) -> bytes:
        return wire.check(*await self.send(wire.read_file(session_id, path)))

    async def list_files(self, session_id: str, path: str = ".") -> list[FileEntry]:
        return wire.entries(*await self.send(wire.list_files(session_id, path)))


class AsyncExecStream(wire.ExecState):
    """`async for chunk in stream`, then `.result` (see `ExecStream`)."""

    def __init__(self, client: AsyncClient, call: wire.Call, *, keep: bool) -> None:
        super().__init__(call, keep=keep)
        self._client = client

    async def __aiter__(self) -> AsyncIterator[Output]:
        self.begin()
        with mapped_errors(self._client.endpoint):
            async with self._client.open_stream(self.call) as resp:
                if resp.status_code >= 300:
                    wire.check(resp.status_code, await resp.aread())
                if self.call.sse:
                    async for ev in EventSource(resp).aiter_sse():
                        if (one := self.decoder.event(ev.event, ev.data)) is not None:
                            yield one
                else:
                    async for data in resp.aiter_bytes():
                        for chunk in self.decoder.feed(data):
                            yield chunk
        self.finish()


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def write(self, path: str, data: bytes | str) -> Written:
        return await self._sb.client.write_file(self._sb.id, path, data)

    async def read(self, path: str) -> bytes:
        return await self._sb.client.read_file(self._sb.id, path)

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def list(self, path: str = ".") -> list[FileEntry]:
        return await self._sb.client.list_files(self._sb.id, path)


class _Opening:
    """What `AsyncSandbox.create/connect` return: await it for the sandbox, or use it in
    `async with` to have the sandbox killed at the end of the block."""

    def __init__(self, make: Callable[[], Awaitable[AsyncSandbox]]) -> None:
        self._make = make
        self._sb: AsyncSandbox | None = None

    def __await__(self) -> Generator[Any, None, AsyncSandbox]:
        return self._make().__await__()

    async def __aenter__(self) -> AsyncSandbox:
        self._sb = await self._make()
        return self._sb

    async def __aexit__(self, *exc: object) -> None:
        if self._sb is not None:
            await self._sb.aclose()


class AsyncSandbox(wire.Handle[AsyncClient]):
    """One session, awaited (see `Sandbox`)."""

    files_class = AsyncFiles
    files: AsyncFiles

    @classmethod
    def create(cls, profile: str, *, client: AsyncClient | None = None,
               launcher: str | None = None, labels: dict[str, str] | None = None,
               ttl_s: int | None = None, env: dict[str, str] | None = None,
               inputs: list[tuple[str, str]] | None = None, **endpoint: Any) -> _Opening:
        """`Sandbox.create`'s arguments; await the answer, or use it in `async with`."""

        async def make() -> AsyncSandbox:
            return await cls._open(client, launcher, endpoint, lambda c: c.create(
                profile, labels=labels, ttl_s=ttl_s, env=env, inputs=inputs))
        return _Opening(make)

    @classmethod
    def connect(cls, session_id: str, *, client: AsyncClient | None = None,
                launcher: str | None = None, **endpoint: Any) -> _Opening:
        async def make() -> AsyncSandbox:
            return await cls._open(client, launcher, endpoint, lambda c: c.get(session_id))
        return _Opening(make)

    @classmethod
    async def _open(cls, client: AsyncClient | None, launcher: str | None,
                    endpoint: dict[str, Any],
                    first: Callable[[AsyncClient], Awaitable[SessionInfo]]) -> AsyncSandbox:
        own = client is None
        c = client or AsyncClient(launcher, **endpoint)
        try:
            return cls(c, await first(c), owns_client=own)
        except BaseException:
            if own:
                await c.aclose()
            raise

    async def refresh(self) -> SessionInfo:
        self.info = await self.client.get(self.id)
        return self.info

    @overload
    async def exec(self, argv: list[str], *, stream: Literal[False] = ...,
                   **kw: Any) -> ExecResult: ...
    @overload
    async def exec(self, argv: list[str], *, stream: Literal[True],
                   **kw: Any) -> AsyncExecStream: ...

    async def exec(self, argv: list[str], *, stream: bool = False,
                   **kw: Any) -> ExecResult | AsyncExecStream:
        if stream:
            return self.client.exec_stream(self.id, argv, **kw)
        return await self.client.exec(self.id, argv, **kw)

    async def kill(self) -> bool:
        return await self.client.kill(self.id)

    async def suspend(self) -> SessionInfo:
        self.info = await self.client.suspend(self.id)
        return self.info

    async def resume(self) -> SessionInfo:
        self.info = await self.client.resume(self.id)
        return self.info

    async def extend(self, ttl_s: int) -> SessionInfo:
        self.info = await self.client.extend(self.id, ttl_s)
        return self.info

    async def record(self, public_key: PublicKey | None = None) -> TaskRecord:
        return await self.client.record(self.id, public_key)

    async def aclose(self) -> None:
        try:
            await self.kill()
        finally:
            if self._owns_client:
                await self.client.aclose()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
