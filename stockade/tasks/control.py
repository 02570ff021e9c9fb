"""Control API shared by the gateway and the broker: register/deregister/list tasks, reload.

HTTP over a Unix socket (mode 0600, owned by root), so a sandbox can never reach it.
The server is an aiohttp app; the client (client.py, re-exported here) is synchronous
stdlib code so the launcher and the CLI can call it without an event loop.
`start_control_server` and `UnixJsonClient` are also the transport of the launcher's
control service (`stockade.launcher.service`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aiohttp import web

from .client import ControlClient, ControlError, UnixJsonClient
from .registry import RegistryError, StateWriteError, Task, TaskRegistry

log = logging.getLogger("stockade.tasks")

ReloadFn = Callable[[], Awaitable[dict[str, Any]]]


def make_control_app(
    registry: TaskRegistry,
    reload: ReloadFn | None = None,
    status: Callable[[], dict[str, Any]] | None = None,
) -> web.Application:
    async def register(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RegistryError("body must be a JSON object")
            task = Task.from_dict(body)
            registry.register(task)
        except StateWriteError as e:
            return _state_write_failed(e)
        except (ValueError, RegistryError) as e:
            return web.json_response({"error": "bad_request", "detail": str(e)}, status=400)
        return web.json_response({"registered": asdict(task)}, status=201)

    async def deregister(request: web.Request) -> web.Response:
        try:
            task = registry.deregister(request.match_info["task_id"])
        except StateWriteError as e:
            return _state_write_failed(e)
        if task is None:
            return web.json_response({"error": "not_found"}, status=404)
        return web.json_response({"deregistered": asdict(task)})

    async def list_tasks(request: web.Request) -> web.Response:
        return web.json_response({"tasks": [asdict(t) for t in registry.tasks()]})

    async def do_reload(request: web.Request) -> web.Response:
        if reload is None:
            return web.json_response({"error": "not_supported"}, status=404)
        result = await reload()
        return web.json_response(result, status=200 if result.get("ok") else 422)

    async def health(request: web.Request) -> web.Response:
        body: dict[str, Any] = {"ok": True, "tasks": len(registry)}
        if status is not None:
            body.update(status())
        return web.json_response(body)

    app = web.Application(client_max_size=64 * 1024)
    app.router.add_post("/v1/tasks", register)
    app.router.add_delete("/v1/tasks/{task_id}", deregister)
    app.router.add_get("/v1/tasks", list_tasks)
    app.router.add_post("/v1/reload", do_reload)
    app.router.add_get("/v1/health", health)
    return app


def _state_write_failed(e: StateWriteError) -> web.Response:
    # 507 Insufficient Storage: the registry did not change (registry.py saves first)
    log.error("task registry: cannot write %s: %s", e.path, e.detail)
    return web.json_response({"error": e.code, "detail": f"{e.code}: {e.detail}"}, status=507)


class _ControlRunner(web.AppRunner):
    """An AppRunner whose cleanup() also removes the socket file it bound: asyncio leaves
    it behind (on 3.11), and a stale socket reads as a service that is down, not gone."""

    def __init__(self, app: web.Application, path: Path) -> None:
        super().__init__(app, access_log=None)
        self.socket_path = path
        self.socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of what we bound

    async def cleanup(self) -> None:
        await super().cleanup()
        ours, self.socket_id = self.socket_id, None
        if ours is not None:
            _unlink_if_ours(self.socket_path, ours)


def _unlink_if_ours(path: Path, ours: tuple[int, int]) -> None:
    # another instance started since may have replaced the file: its socket is not ours
    try:
        st = path.lstat()
        if (st.st_dev, st.st_ino) == ours:
            path.unlink()
    except FileNotFoundError:
        pass


async def start_control_server(
    app: web.Application, socket_path: str | os.PathLike[str]
) -> web.AppRunner:
    """Serve `app` on a root-only Unix socket; returns the runner (call .cleanup(), which
    also removes the socket file if it is still the one bound here)."""
    path = Path(socket_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    runner = _ControlRunner(app, path)
    await runner.setup()
    old = os.umask(0o177)  # the socket exists 0600 from its first instant
    try:
        site = web.UnixSite(runner, str(path))
        await site.start()
        st = path.lstat()
        runner.socket_id = (st.st_dev, st.st_ino)
    except BaseException:
        await runner.cleanup()  # a half-started server would keep the app's resources
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return runner


__all__ = ["ControlClient", "ControlError", "ReloadFn", "UnixJsonClient", "make_control_app",
           "start_control_server"]
