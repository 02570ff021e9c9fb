"""The synchronous SDK: `Client` (one call per API route) and `Sandbox` (a session as an
object: a context manager that kills the sandbox on exit).

    with Sandbox.create(profile="python") as sb:
        sb.files.write("main.py", "print(6 * 7)")
        print(sb.exec(["python3", "main.py"]).stdout)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Literal, overload

import httpx
from httpx_sse import EventSource

from . import wire
from .errors import NotFound, SessionEnded
from .models import ExecResult, FileEntry, Output, SessionInfo, TaskRecord, Written
from .records import PublicKey, task_record
from .transport import Endpoint, mapped_errors, request_kwargs, timeout_of


class Client:
    """The launcher API over one connection pool. `target`: a socket path or an
    http(s):// URL (default: `STOCKADE_LAUNCHER`, else the launcher's default socket);
    the other keywords are `Endpoint`'s (token, token_file, ca, cert, key, timeout)."""

    def __init__(self, target: str | None = None, *, endpoint: Endpoint | None = None,
                 **kw: Any) -> None:
        self.endpoint = endpoint or Endpoint.resolve(target, **kw)
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(**self.endpoint.transport_kwargs()),
            **self.endpoint.client_kwargs())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, call: wire.Call) -> tuple[int, bytes]:
        with mapped_errors(self.endpoint):
            r = self._http.request(call.method, call.path, timeout=timeout_of(self.endpoint, call),
                                   **request_kwargs(call))
            return r.status_code, r.content

    def open_stream(self, call: wire.Call) -> contextlib.AbstractContextManager[httpx.Response]:
        return self._http.stream(call.method, call.path, timeout=timeout_of(self.endpoint, call),
                                 **request_kwargs(call))

    # -- sessions ----------------------------------------------------------------------------
    def create(self, profile: str, **kw: Any) -> SessionInfo:
        """A new session, answered once its sandbox is ready (kw: ttl_s, labels, env,
        inputs)."""
        return wire.session(*self.send(wire.create(profile, **kw)))

    def get(self, session_id: str) -> SessionInfo:
        return wire.session(*self.send(wire.get(session_id)))

    def list(self) -> list[SessionInfo]:
        return wire.sessions(*self.send(wire.list_sessions()))

    def kill(self, session_id: str) -> bool:
        """True once the session has ended (killing an ended one is no error); False
        when the launcher does not know it."""
        try:
            wire.as_json(*self.send(wire.kill(session_id)))
        except (NotFound, SessionEnded):
            return False
        return True

    def suspend(self, session_id: str) -> SessionInfo:
        return wire.session(*self.send(wire.op(session_id, "suspend")))

    def resume(self, session_id: str) -> SessionInfo:
        return wire.session(*self.send(wire.op(session_id, "resume")))

    def extend(self, session_id: str, ttl_s: int) -> SessionInfo:
        """A new TTL from creation; `.capped` when the profile's limit cut it."""
        return wire.session(*self.send(wire.extend(session_id, ttl_s)))

    def record(self, session_id: str, public_key: PublicKey | None = None) -> TaskRecord:
        """The ended session's signed task record, verified with `public_key` when given
        (SessionRunning while it runs)."""
        return task_record(*self.send(wire.record(session_id)), public_key)

    # -- exec --------------------------------------------------------------------------------
    def exec(self, session_id: str, argv: list[str], **kw: Any) -> ExecResult:
        """Run `argv` in the session and wait for its end (kw: env, cwd, stdin, timeout_s)."""
        stream = self.exec_stream(session_id, argv, keep=True, **kw)
        for _ in stream:
            pass
        return stream.result

    def exec_stream(self, session_id: str, argv: list[str], *, keep: bool = False,
                    **kw: Any) -> ExecStream:
        return ExecStream(self, wire.exec_call(session_id, argv, **kw), keep=keep)

    # -- files -------------------------------------------------------------------------------
    def write_file(self, session_id: str, path: str, data: bytes | str) -> Written:
        return wire.written(*self.send(wire.write_file(session_id, path, data)))

    def read_file(self, session_id: str, path: str) -> bytes:
        return wire.check(*self.send(wire.read_file(session_id, path)))

    def list_files(self, session_id: str, path: str = ".") -> list[FileEntry]:
        return wire.entries(*self.send(wire.list_files(session_id, path)))


class ExecStream(wire.ExecState):
    """An exec's output as it comes (`for chunk in stream`), then `.result`. Leaving the
    loop early closes the answer, and the launcher then kills the exec."""

    def __init__(self, client: Client, call: wire.Call, *, keep: bool) -> None:
        super().__init__(call, keep=keep)
        self._client = client

    def __iter__(self) -> Iterator[Output]:
        self.begin()
        with mapped_errors(self._client.endpoint), self._client.open_stream(self.call) as resp:
            if resp.status_code >= 300:
                wire.check(resp.status_code, resp.read())
            if self.call.sse:
                for ev in EventSource(resp).iter_sse():
                    if (chunk := self.decoder.event(ev.event, ev.data)) is not None:
                        yield chunk
            else:
                for data in resp.iter_bytes():
                    yield from self.decoder.feed(data)
        self.finish()


class Files:
    """A session's scratch: paths relative to it (absolute, `..`, symlinks: PathRefused)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def write(self, path: str, data: bytes | str) -> Written:
        return self._sb.client.write_file(self._sb.id, path, data)

    def read(self, path: str) -> bytes:
        return self._sb.client.read_file(self._sb.id, path)

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def list(self, path: str = ".") -> list[FileEntry]:
        return self._sb.client.list_files(self._sb.id, path)


class Sandbox(wire.Handle[Client]):
    """One session. `Sandbox.create(...)` starts one; `Sandbox.connect(id)` attaches to a
    running one. As a context manager it kills the sandbox on exit, error or not."""

    files_class = Files
    files: Files

    @classmethod
    def create(cls, profile: str, *, labels: dict[str, str] | None = None,
               ttl_s: int | None = None, env: dict[str, str] | None = None,
               inputs: list[tuple[str, str]] | None = None, client: Client | None = None,
               launcher: str | None = None, **endpoint: Any) -> Sandbox:
        """A new session, once its sandbox is ready; `launcher` and `endpoint` (token,
        token_file, ca, cert, key, timeout) say where, unless `client` is given."""
        return cls._open(client, launcher, endpoint, lambda c: c.create(
            profile, labels=labels, ttl_s=ttl_s, env=env, inputs=inputs))

    @classmethod
    def connect(cls, session_id: str, *, client: Client | None = None,
                launcher: str | None = None, **endpoint: Any) -> Sandbox:
        return cls._open(client, launcher, endpoint, lambda c: c.get(session_id))

    @classmethod
    def _open(cls, client: Client | None, launcher: str | None, endpoint: dict[str, Any],
              first: Callable[[Client], SessionInfo]) -> Sandbox:
        own = client is None
        c = client or Client(launcher, **endpoint)
        try:
            return cls(c, first(c), owns_client=own)
        except BaseException:
            if own:
                c.close()
            raise

    def refresh(self) -> SessionInfo:
        self.info = self.client.get(self.id)
        return self.info

    @overload
    def exec(self, argv: list[str], *, stream: Literal[False] = ..., **kw: Any) -> ExecResult: ...
    @overload
    def exec(self, argv: list[str], *, stream: Literal[True], **kw: Any) -> ExecStream: ...

    def exec(self, argv: list[str], *, stream: bool = False, **kw: Any) -> ExecResult | ExecStream:
        """Run `argv` (kw: env, cwd, stdin, timeout_s): the result, or with `stream=True`
        an `ExecStream` to iterate."""
        if stream:
            return self.client.exec_stream(self.id, argv, **kw)
        return self.client.exec(self.id, argv, **kw)

    def kill(self) -> bool:
        return self.client.kill(self.id)

    def suspend(self) -> SessionInfo:
        self.info = self.client.suspend(self.id)
        return self.info

    def resume(self) -> SessionInfo:
        self.info = self.client.resume(self.id)
        return self.info

    def extend(self, ttl_s: int) -> SessionInfo:
        self.info = self.client.extend(self.id, ttl_s)
        return self.info

    def record(self, public_key: PublicKey | None = None) -> TaskRecord:
        """The signed task record, once the session has ended (after `kill()`: it waits
        for the teardown); verified with `public_key` (the host's signing.pub) if given."""
        return self.client.record(self.id, public_key)

    def close(self) -> None:
        """Kill the sandbox (if it still runs) and close a client this object opened."""
        try:
            self.kill()
        finally:
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
