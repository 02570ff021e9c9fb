"""The session routes of the launcher's control service (`/v1/sessions...`).

A session is a `Launcher.run` of a `SandboxSpec(session=True)` in a thread of the service
(`LauncherService.launch`): the sandbox holds until it is killed, its TTL expires or its
profile's cap ends it; each exec is `Launcher.exec` driven by `execrun.drive` in a thread,
its chunks handed to the loop and written as NDJSON (or SSE) while the command runs.
Bodies are the pydantic models of `session_api.py`; files go through `files.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from . import files, initscript, openapi
from .execrun import ExecControl, ExecLimits, drive
from .execspec import ExecSpec
from .isolation import choose_backend, preflight
from .session_api import ExecRequest, SessionCreate, TtlRequest, field_of
from .sessions import SessionRow, SessionTable, extend, new_row
from .spec import TASK_ID_RE, EndedBy, LauncherError, SandboxSpec
from .transport import host_path_refusal

if TYPE_CHECKING:  # annotations only
    from .service import LauncherService

log = logging.getLogger("stockade.launcher.sessions")

MAX_EXECS = 64  # running execs per session
FILE_MAX = 64 * 2**20  # one file read or written (the profile's disk caps it further)
# file bodies moved at once across the service: each is held whole in memory (up to
# FILE_MAX), so without a cap concurrent uploads could take the host's memory
FILE_TRANSFERS = 4
# of those, one session's: its orchestrator's slow or stalled bodies leave the other
# sessions' files a place
FILE_TRANSFERS_PER_SESSION = 2
# a body that sends nothing for this long is refused: a stalled client would otherwise
# hold one of the FILE_TRANSFERS places (and its buffer) for ever
FILE_BODY_IDLE_S = 30.0
EXPIRY_EVERY_S = 0.5
RECORD_WAIT_S = 60.0  # a killed session's teardown, on a loaded host
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, code: str, detail: str, field: str | None = None) -> web.Response:
    body: dict[str, Any] = {"error": code, "detail": detail}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status)


class Refused(Exception):
    def __init__(self, response: web.Response) -> None:
        super().__init__(response.text)
        self.response = response


def _guard(handler: Handler) -> Handler:
    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except Refused as r:
            return r.response
        except files.FileError as e:
            return error(e.status, e.code, e.detail, "path")
    return run


async def _model(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        body = await request.json()
    except ValueError:
        raise Refused(error(400, "bad_request", "body must be JSON", "body")) from None
    try:
        return model.model_validate(body)
    except ValidationError as e:
        field, detail = field_of(e)
        raise Refused(error(400, "bad_request", detail, field)) from None


class Transfers:
    """The places for file bodies in memory: FILE_TRANSFERS across the service, at most
    FILE_TRANSFERS_PER_SESSION of them one session's. A session's gate is kept only
    while one of its transfers waits or runs."""

    def __init__(self) -> None:
        self._all = asyncio.Semaphore(FILE_TRANSFERS)
        self._sessions: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def place(self, sid: str) -> AsyncIterator[None]:
        gate, users = self._sessions.get(sid, (None, 0))
        gate = gate or asyncio.Semaphore(FILE_TRANSFERS_PER_SESSION)
        self._sessions[sid] = (gate, users + 1)
        try:
            async with gate, self._all:
                yield
        finally:
            users = self._sessions[sid][1] - 1
            if users:
                self._sessions[sid] = (gate, users)
            else:
                del self._sessions[sid]

    def sessions(self) -> int:
        return len(self._sessions)


class SessionRoutes:
    def __init__(self, svc: LauncherService) -> None:
        self.svc = svc
        self.launcher = svc.launcher
        self.table = SessionTable()
        self._expiry: asyncio.Task[None] | None = None
        self.transfers = Transfers()

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/sessions", _guard(self.create))
        r.add_get("/v1/sessions", _guard(self.list))
        r.add_get("/v1/sessions/{sid}", _guard(self.get))
        r.add_delete("/v1/sessions/{sid}", _guard(self.kill))
        r.add_get("/v1/sessions/{sid}/record", _guard(self.record))
        r.add_post("/v1/sessions/{sid}/suspend", _guard(self.suspend))
        r.add_post("/v1/sessions/{sid}/resume", _guard(self.resume))
        r.add_post("/v1/sessions/{sid}/ttl", _guard(self.ttl))
        r.add_post("/v1/sessions/{sid}/exec", _guard(self.exec))
        r.add_put("/v1/sessions/{sid}/files", _guard(self.put_file))
        r.add_get("/v1/sessions/{sid}/files", _guard(self.get_file))
        r.add_get("/openapi.json", self.openapi)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document())

    # -- expiry ------------------------------------------------------------------------------
    def start(self) -> None:
        self._expiry = asyncio.create_task(self._expire_loop())

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_EVERY_S)
            for sid in self.table.expired(time.time()):
                row = self.table.get(sid)
                if row is not None:
                    await self._end(row, "ttl")

    async def _end(self, row: SessionRow, ended_by: EndedBy) -> None:
        for c in list(row.execs):
            c.kill("killed")
        row.state = "ended"
        try:
            await asyncio.to_thread(self.launcher.kill, row.session_id, ended_by)
        except Exception:  # the kill's own errors are in the log; the session is over
            log.exception("session %s: kill (%s) failed", row.session_id, ended_by)

    # -- lifecycle ---------------------------------------------------------------------------
    def _row(self, request: web.Request, *, live: bool = True) -> SessionRow:
        sid = request.match_info["sid"]
        if not TASK_ID_RE.match(sid):
            raise Refused(error(400, "bad_request", "session id must be 10 hex characters",
                                "session_id"))
        row = self.table.get(sid)
        if row is None:
            raise Refused(error(404, "not_found", f"no session {sid}"))
        if live and row.state == "ended":
            raise Refused(error(409, "session_ended", f"session {sid} has ended"))
        return row

    def _spec(self, req: SessionCreate, ruleset: Any) -> tuple[SandboxSpec, Any, str]:
        profile = ruleset.profiles.get(req.profile)
        if profile is None:
            raise Refused(error(400, "profile_unknown", f"unknown profile {req.profile!r}",
                                "profile"))
        try:
            preflight(self.launcher.s, ruleset, req.profile)
            _, iso = choose_backend(self.launcher.s, profile)
        except LauncherError as e:
            raise Refused(error(400, "launcher_error", str(e), "profile")) from None
        for i, b in enumerate(req.inputs):
            if not os.path.exists(b.host):
                raise Refused(error(400, "bad_request", f"inputs[{i}]: host path does not "
                                    f"exist: {b.host}", f"inputs.{i}.host"))
        spec = SandboxSpec(profile=req.profile, argv=[],
                           inputs=[(b.host, b.guest) for b in req.inputs], env=dict(req.env),
                           session=True, labels=dict(req.labels))
        return spec, profile, iso["isolation"]

    async def create(self, request: web.Request) -> web.Response:
        req = await _model(request, SessionCreate)
        if refused := host_path_refusal(request, self.launcher.s.control_host_paths,
                                        [(f"inputs.{i}.host", b.host)
                                         for i, b in enumerate(req.inputs)]):
            return error(400, "bad_request", refused[1], refused[0])
        ruleset = self.svc.rules.current
        spec, profile, isolation = self._spec(req, ruleset)
        if self.svc.closing:
            return error(503, "shutting_down", "the launcher service is stopping")
        run = self.svc.launch(spec, ruleset)
        await asyncio.wait({run.started, run.finished}, return_when=asyncio.FIRST_COMPLETED)
        if not run.started.done():
            _status, out = run.finished.result()
            return error(503, "launcher_error", str(out.get("detail", "start failed")))
        sid = run.started.result()
        row = new_row(sid, spec.profile, isolation, time.time(), req.ttl_s,
                      int(profile.limits.ttl), dict(req.labels), spec)
        # nothing larger fits in its scratch
        row.file_limit = min(FILE_MAX, int(profile.limits.disk or FILE_MAX))
        row.finished = run.finished
        self.table.add(row)
        run.finished.add_done_callback(lambda _f: self.table.ended(sid))
        if run.finished.done():  # it ended between its start and here
            self.table.ended(sid)
        return web.json_response(row.view(), status=201)

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response({"sessions": [r.view() for r in self.table.rows()]})

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self._row(request, live=False).view())

    async def kill(self, request: web.Request) -> web.Response:
        row = self._row(request, live=False)
        if row.state != "ended":
            await self._end(row, "killed")
        return web.json_response({"killed": True})

    async def record(self, request: web.Request) -> web.Response:
        """The signed task record of an ended session (its run's, `RunResult.record`);
        a session that was just killed answers once its teardown wrote it."""
        row = self._row(request, live=False)
        if row.state != "ended" or row.finished is None:
            return error(409, "session_running", f"session {row.session_id} is running: "
                         "its record is written when it ends")
        try:
            status, out = await asyncio.wait_for(asyncio.shield(row.finished), RECORD_WAIT_S)
        except TimeoutError:
            return error(503, "record_pending", f"session {row.session_id} is still being "
                         "torn down")
        record = out.get("record") if status == 200 else None
        if record is None:  # its sandbox was removed elsewhere (a reconcile): no record
            return error(404, "no_record", f"session {row.session_id} left no record")
        return web.json_response(record)

    async def _freeze(self, request: web.Request, frozen: bool) -> web.Response:
        row = self._row(request)
        op = self.launcher.suspend if frozen else self.launcher.resume
        try:
            ok = await asyncio.to_thread(op, row.session_id)
        except LauncherError as e:
            return error(503, "launcher_error", str(e))
        if not ok:
            return error(409, "session_ended", f"session {row.session_id} has ended")
        row.state = "frozen" if frozen else "ready"
        return web.json_response(row.view())

    async def suspend(self, request: web.Request) -> web.Response:
        return await self._freeze(request, True)

    async def resume(self, request: web.Request) -> web.Response:
        return await self._freeze(request, False)

    async def ttl(self, request: web.Request) -> web.Response:
        row = self._row(request)
        req = await _model(request, TtlRequest)
        return web.json_response(extend(row, req.ttl_s, time.time()).view())

    # -- exec --------------------------------------------------------------------------------
    def _exec_spec(self, req: ExecRequest) -> ExecSpec:
        try:
            stdin = req.stdin_bytes()
        except ValueError as e:
            raise Refused(error(400, "bad_request", str(e), "stdin")) from None
        cwd = initscript.SCRATCH
        if req.cwd:
            try:
                cwd += "/" + "/".join(files.check_rel(req.cwd, allow_root=True))
            except files.FileError as e:
                raise Refused(error(400, "path_refused", e.detail, "cwd")) from None
        return ExecSpec(tuple(req.argv), dict(req.env), cwd.rstrip("/"), stdin, req.timeout_s)

    async def exec(self, request: web.Request) -> web.StreamResponse:
        row = self._row(request)
        req = await _model(request, ExecRequest)
        spec = self._exec_spec(req)
        if row.state == "frozen":
            return error(409, "busy", f"session {row.session_id} is suspended")
        if len(row.execs) >= MAX_EXECS:
            return error(429, "busy", f"at most {MAX_EXECS} execs run at once in a session")
        control = ExecControl()
        row.execs.add(control)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        started: asyncio.Future[None] = loop.create_future()

        def emit(item: dict[str, Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone at shutdown
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def settle(failed: LauncherError | None) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, started, failed)

        # one thread starts the exec and drives it: no hop through the loop between them
        threading.Thread(target=self._run_exec, daemon=True, name="stockade-exec",
                         args=(row, spec, control, settle, emit)).start()
        try:
            try:
                await started
            except LauncherError as e:
                return error(409, "session_ended", str(e))
            if not req.stream:
                return await _collect(queue)
            return await _stream(request, queue)
        finally:
            control.kill("killed")  # a client gone mid-stream: the exec goes with it
            row.execs.discard(control)

    def _run_exec(self, row: SessionRow, spec: ExecSpec, control: ExecControl,
                  settle: Callable[[LauncherError | None], None],
                  emit: Callable[[dict[str, Any]], None]) -> None:
        sid = row.session_id
        try:
            mark = self.launcher.denials_mark(sid)
            if row.scrubber is None:
                row.scrubber = self.launcher.scrubber(sid, row.spec)
            proc = self.launcher.exec(sid, spec)
        except LauncherError as e:
            settle(e)
            return
        except BaseException as e:  # not a refusal: the handler must not wait forever
            settle(LauncherError(f"the exec did not start: {e}"))
            raise
        settle(None)
        limits = ExecLimits(self.launcher.s.max_output_bytes, spec.timeout_s)
        drive(proc, spec.stdin, limits, row.scrubber, control, emit,
              lambda: self.launcher.denials(sid, mark))

    # -- files -------------------------------------------------------------------------------
    def _file_target(self, request: web.Request) -> tuple[str, str, int]:
        """(session id, scratch root, file size limit)."""
        row = self._row(request)
        root = self.launcher.scratch_root(row.session_id)
        if root is None:
            raise Refused(error(409, "session_ended", f"session {row.session_id} has ended"))
        return row.session_id, root, row.file_limit

    async def put_file(self, request: web.Request) -> web.Response:
        sid, root, limit = self._file_target(request)
        path = request.query.get("path")
        if path is None:
            return error(400, "bad_request", "the path query parameter is required", "path")
        files.check_rel(path)
        if request.content_length is not None and request.content_length > limit:
            return error(413, "too_large", f"a file may hold at most {limit} bytes", "body")
        owner = files.Owner(self.launcher.s.sandbox_uid, self.launcher.s.sandbox_gid)
        async with self.transfers.place(sid):
            try:
                data = await _read_capped(request, limit)
            except TimeoutError:
                return error(408, "bad_request", f"the body sent nothing for "
                             f"{FILE_BODY_IDLE_S:.0f} s", "body")
            if data is None:
                return error(413, "too_large", f"a file may hold at most {limit} bytes",
                             "body")
            size = await asyncio.to_thread(files.write, root, path, iter([data]), limit,
                                           owner)
        return web.json_response({"path": path, "size": size})

    async def get_file(self, request: web.Request) -> web.StreamResponse:
        sid, root, limit = self._file_target(request)
        if "list" in request.query:
            entries = await asyncio.to_thread(files.listing, root, request.query["list"])
            return web.json_response({"entries": entries})
        path = request.query.get("path")
        if path is None:
            return error(400, "bad_request", "path or list query parameter is required",
                         "path")
        async with self.transfers.place(sid):  # held until the body is sent: in memory
            data = await asyncio.to_thread(files.read, root, path, limit)
            return await _send(request, data)


def _settle(fut: asyncio.Future[None], failed: LauncherError | None) -> None:
    if fut.done():
        return
    if failed is None:
        fut.set_result(None)
    else:
        fut.set_exception(failed)


async def _send(request: web.Request, data: bytes) -> web.StreamResponse:
    """`data` as the response, a piece at a time: a client that takes none of a piece
    for FILE_BODY_IDLE_S is cut off (its connection closed), as a stalled upload is."""
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = len(data)
    await resp.prepare(request)
    view = memoryview(data)
    try:
        for i in range(0, len(view), 1 << 20):
            await asyncio.wait_for(resp.write(view[i:i + (1 << 20)]), FILE_BODY_IDLE_S)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        return resp
    await resp.write_eof()
    return resp


async def _read_capped(request: web.Request, limit: int) -> bytearray | None:
    """The body, None past `limit`; TimeoutError when it stalls FILE_BODY_IDLE_S."""
    buf = bytearray()  # handed on as it is: a bytes() copy would double the peak
    while chunk := await asyncio.wait_for(request.content.read(1 << 16), FILE_BODY_IDLE_S):
        buf += chunk
        if len(buf) > limit:
            return None
    return buf


async def _collect(queue: asyncio.Queue[dict[str, Any]]) -> web.Response:
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}
    while (item := await queue.get())["type"] != "exit":
        out[item["type"]].append(item["data"])
    item.pop("type")
    return web.json_response({"stdout": "".join(out["stdout"]),
                              "stderr": "".join(out["stderr"]), **item})


async def _stream(request: web.Request, queue: asyncio.Queue[dict[str, Any]]
                  ) -> web.StreamResponse:
    sse = "text/event-stream" in request.headers.get("Accept", "")
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream" if sse else "application/x-ndjson",
        "Cache-Control": "no-store"})
    await resp.prepare(request)
    while True:
        item = await queue.get()
        line = json.dumps(item, separators=(",", ":"))
        await resp.write((f"event: {item['type']}\ndata: {line}\n\n" if sse
                          else line + "\n").encode())
        if item["type"] == "exit":
            break
    await resp.write_eof()
    return resp
