"""The launcher's control service: sandboxes driven over a root-only Unix socket, and
over TCP with a bearer token (`transport.py`) when `launcher.control_listen` is set.

`stockade launcher serve` keeps one `Launcher` (nft table, NFLOG reader, reconciliation)
behind an aiohttp app on `launcher.control_socket`, so an orchestrator can start, list,
kill, suspend and resume sandboxes without linking the launcher in-process. The transport
is the one of the gateway's and broker's control API (`start_control_server`: mode 0600
from the first instant; `UnixJsonClient`: synchronous stdlib client).

Routes: `GET /v1/health`, `GET /v1/sandboxes`, `POST /v1/sandboxes` (run; `"wait": false`
answers 202 once the sandbox exists), `GET /v1/sandboxes/{id}/result`,
`DELETE /v1/sandboxes/{id}` (kill), `POST /v1/sandboxes/{id}/suspend|resume`,
`POST /v1/reload`; the sessions under `/v1/sessions` (`session_routes.py`) and
`GET /openapi.json`. Request validation (`run_request.py`: `parse_run_request`) is pure;
every `Launcher.run` gets its own thread (runs last up to the TTL, so they must not occupy
the loop's shared executor that list/kill/suspend use).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from stockade.loops import every
from stockade.tasks.control import ControlError, UnixJsonClient, start_control_server

from .core import Launcher
from .isolation import preflight
from .run_request import (  # re-exported: the service's public request format
    RequestError,
    parse_run_request,
    result_from_json,
    run_request,
)
from .session_routes import SessionRoutes
from .spec import TASK_ID_RE, LauncherError, RunResult, SandboxSpec
from .transport import TokenFile, auth_middleware, host_path_refusal, start_tcp

if TYPE_CHECKING:  # annotations only
    from .configview import LauncherConfig as Config

log = logging.getLogger("stockade.launcher.service")

MAX_BODY = 1 * 2**20  # a request is a command line and a few paths, never data
RESULTS_KEPT = 256  # finished results kept for GET .../result (oldest dropped first)


def _error(status: int, code: str, detail: str, **extra: Any) -> web.Response:
    return web.json_response({"error": code, "detail": detail, **extra}, status=status)


# -- the service -----------------------------------------------------------------------------
@dataclass
class _Run:
    """One sandbox run driven by the service; its thread reports through the two futures."""

    loop: asyncio.AbstractEventLoop
    started: asyncio.Future[str]  # the task id, once the sandbox exists
    finished: asyncio.Future[tuple[int, dict[str, Any]]]  # (HTTP status, body)
    task_id: str | None = None

    def _set(self, fut: asyncio.Future[Any], value: Any) -> None:
        if not fut.done():
            fut.set_result(value)

    def report(self, fut: asyncio.Future[Any], value: Any) -> None:
        # called from the run's thread; the loop may already be gone at shutdown
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._set, fut, value)


class LauncherService:
    def __init__(self, config: Config, *, launcher: Launcher | None = None) -> None:
        from stockade.policy.holder import RulesHolder

        self.config = config
        # events.stdout as configured: in a pod, the node's log agent reads the containers'
        # stdout (only `stockade run`, whose stdout is its result, keeps it off: core.py)
        self.events = config.event_writer()
        # the service keeps `launcher.pools` (a one-shot `stockade run` does not)
        self.launcher = launcher or Launcher(config, events=self.events, pools=True)
        # the gateway's holder: an invalid reload keeps the rules in force (fail closed)
        self.rules = RulesHolder(config.rules_dir, self.events.write, component="launcher")
        self.socket_path = config.launcher.control_socket
        self._runner: web.AppRunner | None = None
        self._reconciler: asyncio.Task[None] | None = None
        self._rules_watch: asyncio.Task[None] | None = None
        self._closing = False
        # task id -> run (this service's); touched only on the loop thread (run threads
        # hand over through call_soon_threadsafe), so no lock
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        # run threads; mutated only on the loop thread, read by stop() once no run can start
        self._threads: set[threading.Thread] = set()
        self._starting: dict[int, _Run] = {}  # thread ident -> its run, until it has an id
        # the start event is written from the run's own thread: the thread says which run
        self.launcher.events.subscribe(self._on_event)
        self.sessions = SessionRoutes(self)
        s = config.launcher
        self.tokens = TokenFile(s.control_token_file) if s.control_listen and \
            s.control_token_file else None

    @property
    def closing(self) -> bool:
        return self._closing

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Rules (RulesError: refuse to start), then the launcher (nft table, reconcile),
        then the socket: a client that can connect finds a working launcher."""
        self.rules.load_initial()
        if self.tokens is not None:
            self.tokens.load()  # LauncherError: no TCP listener without a usable token
        await asyncio.to_thread(self.launcher.start)
        self._runner = await start_control_server(self.app(), self.socket_path)
        if self.tokens is not None:
            try:
                await start_tcp(self._runner, self.config.launcher)
            except BaseException:
                await self._runner.cleanup()
                raise
        # sandboxes of a `stockade run` that died (SIGKILL) are removed, with their end
        # event, within one period, not only at the next run's start
        self._reconciler = asyncio.create_task(every(
            self.config.launcher.reconcile_interval_s,
            lambda: asyncio.to_thread(self.launcher.reconcile),
            "launcher: orphan reconcile", log))
        self._rules_watch = asyncio.create_task(every(
            self.config.launcher.rules_poll_interval_s,
            lambda: asyncio.to_thread(self.rules.poll), "launcher: rule file polling", log))
        self.sessions.start()

    async def stop(self) -> None:
        """Refuse new runs, kill this service's sandboxes, wait for their teardown, close
        the socket, then `Launcher.close()` (the last launcher out removes the nft table)."""
        self._closing = True
        await self.sessions.stop()
        for task in (self._reconciler, self._rules_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._reconciler = self._rules_watch = None
        await asyncio.to_thread(self._kill_own_and_wait)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await asyncio.to_thread(self.launcher.close)
        # the socket file went with the runner's cleanup, only if it was still ours
        self.events.close()

    def _kill_own_and_wait(self, timeout: float = 60.0) -> None:
        # repeated: a run that was still before its `_create` gets killed on the next pass.
        # Only after every run thread is done may close() look for the table's last user.
        end = time.monotonic() + timeout
        while True:
            alive = [t for t in list(self._threads) if t.is_alive()]
            if not alive or time.monotonic() > end:
                return
            for r in self.launcher.list():
                if r["owner_pid"] == os.getpid():
                    self.launcher.kill(r["task_id"])
            for t in alive:
                t.join(timeout=0.2)

    def reload(self, trigger: str) -> dict[str, Any]:
        return self.rules.reload(trigger)

    def _on_event(self, ev: dict[str, Any]) -> None:
        run = self._starting.get(threading.get_ident())
        if (run is None or ev.get("event", {}).get("action") != "sandbox_lifecycle"
                or ev.get("stockade", {}).get("lifecycle") != "start"):
            return
        task_id = ev.get("labels", {}).get("task_id")
        if isinstance(task_id, str):
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting
                run.loop.call_soon_threadsafe(self._started, run, task_id)

    def _started(self, run: _Run, task_id: str) -> None:
        run.task_id = task_id
        self._runs[task_id] = run
        self._trim()
        if not run.started.done():
            run.started.set_result(task_id)

    def _trim(self) -> None:
        finished = [tid for tid, r in self._runs.items() if r.finished.done()]
        for tid in finished[: max(0, len(finished) - RESULTS_KEPT)]:
            del self._runs[tid]

    def _worker(self, run: _Run, spec: SandboxSpec, ruleset: Any) -> None:
        self._starting[threading.get_ident()] = run
        try:
            outcome: tuple[int, dict[str, Any]] = (200, self.launcher.run(spec, ruleset).to_json())
        except (RuntimeError, OSError) as e:  # LauncherError, pool exhausted, nft, gone input
            outcome = (503, {"error": "launch_failed", "detail": str(e)})
        except Exception as e:  # never a traceback to the client; the log has it
            log.exception("sandbox run failed")
            outcome = (500, {"error": "internal_error", "detail": type(e).__name__})
        finally:
            self._starting.pop(threading.get_ident(), None)
        run.report(run.finished, outcome)

    def launch(self, spec: SandboxSpec, ruleset: Any) -> _Run:
        """`Launcher.run(spec)` in a thread of its own; the run reports through its
        futures (`started` once the sandbox exists). Call only on the loop's thread."""
        loop = asyncio.get_running_loop()
        run = _Run(loop, loop.create_future(), loop.create_future())
        t = threading.Thread(target=self._worker, args=(run, spec, ruleset), daemon=True,
                             name="stockade-sandbox")
        self._threads = {x for x in self._threads if x.is_alive()}
        self._threads.add(t)
        t.start()
        return run

    # -- the HTTP app ------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[
            auth_middleware(self.tokens)] if self.tokens is not None else [])
        app.router.add_get("/v1/health", self._health)
        app.router.add_get("/v1/sandboxes", self._list)
        app.router.add_post("/v1/sandboxes", self._run)
        app.router.add_get("/v1/sandboxes/{task_id}/result", self._result)
        app.router.add_delete("/v1/sandboxes/{task_id}", self._kill)
        app.router.add_post("/v1/sandboxes/{task_id}/suspend", self._suspend)
        app.router.add_post("/v1/sandboxes/{task_id}/resume", self._resume)
        app.router.add_post("/v1/reload", self._reload)
        app.router.add_get("/v1/metrics", self._metrics)
        self.sessions.add_to(app)
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        """Prometheus text: the warm pools' counters (empty without pools)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        pools = self.launcher.pools
        body = generate_latest(pools.metrics.registry) if pools is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, request: web.Request) -> web.Response:
        running = sum(1 for r in self._runs.values() if not r.finished.done())
        return web.json_response({
            "ok": not self._closing, "sandboxes": running,
            "rules": self.rules.current.version, "nflog_bound": self.launcher.nflog_bound,
            "pools": self.launcher.pools.rows() if self.launcher.pools is not None else [],
        })

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"sandboxes": await asyncio.to_thread(self.launcher.list)})

    async def _run(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "bad_request", "body must be JSON", field="body")
        ruleset = self.rules.current  # one snapshot for the whole run
        try:
            spec, wait = parse_run_request(body, ruleset.profiles)
        except RequestError as e:
            return _error(400, "bad_request", str(e), field=e.field)
        try:
            preflight(self.launcher.s, ruleset, spec.profile)
        except LauncherError as e:  # e.g. an isolation tier this backend cannot give
            return _error(400, "bad_request", str(e), field="profile")
        named = [(f"inputs[{i}]", h) for i, (h, _g) in enumerate(spec.inputs)]
        if spec.export_dir is not None:
            named.append(("export_dir", spec.export_dir))
        if refused := host_path_refusal(request, self.launcher.s.control_host_paths, named):
            return _error(400, "bad_request", refused[1], field=refused[0])
        for i, (host, _guest) in enumerate(spec.inputs):
            if not os.path.exists(host):
                return _error(400, "bad_request", f"inputs[{i}]: host path does not exist: "
                              f"{host}", field=f"inputs[{i}]")
        # checked after the last await: stop() sets it on this thread before it waits
        if self._closing:
            return _error(503, "shutting_down", "the launcher service is stopping")
        run = self.launch(spec, ruleset)
        if not wait:
            # answered once the sandbox exists (or failed): the id can be killed at once
            await asyncio.wait({run.started, run.finished},
                               return_when=asyncio.FIRST_COMPLETED)
            if run.started.done():
                return web.json_response({"task_id": run.started.result(), "state": "running"},
                                         status=202)
        # shielded: a client that goes away does not cancel the bookkeeping; the sandbox
        # runs to its end and its result stays available under GET .../result
        status, out = await asyncio.shield(run.finished)
        return web.json_response(out, status=status)

    def _task_id(self, request: web.Request) -> str | None:
        tid = request.match_info["task_id"]
        return tid if TASK_ID_RE.match(tid) else None

    async def _result(self, request: web.Request) -> web.Response:
        tid = self._task_id(request)
        if tid is None:
            return _error(400, "bad_request", "task id must be 10 hex characters",
                          field="task_id")
        run = self._runs.get(tid)
        if run is None:
            return _error(404, "not_found", f"no result for sandbox {tid} in this service")
        if not run.finished.done():
            return web.json_response({"task_id": tid, "state": "running"}, status=202)
        status, out = run.finished.result()
        return web.json_response(out, status=status)

    async def _op(self, request: web.Request, op: str) -> web.Response:
        tid = self._task_id(request)
        if tid is None:
            return _error(400, "bad_request", "task id must be 10 hex characters",
                          field="task_id")
        ok = await asyncio.to_thread(getattr(self.launcher, op), tid)
        if not ok:
            return _error(404, "not_found", f"no sandbox {tid}")
        return web.json_response({"task_id": tid, op: True})

    async def _kill(self, request: web.Request) -> web.Response:
        return await self._op(request, "kill")

    async def _suspend(self, request: web.Request) -> web.Response:
        return await self._op(request, "suspend")

    async def _resume(self, request: web.Request) -> web.Response:
        return await self._op(request, "resume")

    async def _reload(self, request: web.Request) -> web.Response:
        result = self.reload("control_api")
        return web.json_response(result, status=200 if result.get("ok") else 422)


async def serve(config: Config) -> int:
    """`stockade launcher serve`: run until SIGTERM/SIGINT; SIGHUP reloads the rules."""
    from stockade.policy import RulesError

    from stockade.serving import serve_until_signalled

    svc: LauncherService | None = None

    async def start() -> None:
        nonlocal svc
        # built here: an unusable event-chain key or state dir is a start-up error too
        svc = LauncherService(config)
        await svc.start()

    async def stop() -> None:
        if svc is not None:
            await svc.stop()

    def banner() -> str:
        assert svc is not None
        return f"serving on {svc.socket_path}, rules {svc.rules.current.version}"

    # a SIGTERM during start-up still ends in stop() (table removed)
    return await serve_until_signalled(
        "launcher", start=start, stop=stop,
        reload=lambda: svc.reload("sighup") if svc is not None else None,
        banner=banner, start_errors=(RuntimeError, OSError), invalid_rules=(RulesError,),
    )


# -- the client ------------------------------------------------------------------------------
class LauncherClient(UnixJsonClient):
    """Synchronous client of `stockade launcher serve` (the orchestrators' API); mirrors
    `Launcher`: run/list/kill/suspend/resume. Refusals raise `ControlError` (.status, .body)."""

    def run(self, spec: SandboxSpec) -> RunResult:
        """Run `spec` and wait for its end (no client timeout: the TTL bounds a run)."""
        return result_from_json(self._call("POST", "/v1/sandboxes", run_request(spec),
                                           wait_forever=True))

    def start(self, spec: SandboxSpec) -> str:
        """Start `spec` without waiting; returns the task id (the sandbox exists by then)."""
        return str(self._call("POST", "/v1/sandboxes", run_request(spec, wait=False),
                              wait_forever=True)["task_id"])

    def result(self, task_id: str) -> RunResult | None:
        """The result of a sandbox started through this service; None while it runs."""
        d = self._call("GET", f"/v1/sandboxes/{task_id}/result")
        return None if d.get("state") == "running" else result_from_json(d)

    def list(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/sandboxes")["sandboxes"])

    def _op(self, method: str, path: str) -> bool:
        try:
            self._call(method, path)
        except ControlError as e:
            if e.status == 404:
                return False
            raise
        return True

    def kill(self, task_id: str) -> bool:
        return self._op("DELETE", f"/v1/sandboxes/{task_id}")

    def suspend(self, task_id: str) -> bool:
        return self._op("POST", f"/v1/sandboxes/{task_id}/suspend")

    def resume(self, task_id: str) -> bool:
        return self._op("POST", f"/v1/sandboxes/{task_id}/resume")
