"""The control API's synchronous client side (stdlib only): JSON over HTTP on a Unix
socket. Kept apart from the aiohttp server in control.py so that the launcher's
deregistration and the short-lived CLI commands do not import aiohttp."""

from __future__ import annotations

import http.client
import json
import os
import socket
from dataclasses import asdict
from typing import Any

from .registry import Task


class ControlError(RuntimeError):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"control API answered {status}: {body}")
        self.status = status
        self.body = body

    def describe(self) -> str:
        """`507 state_write_failed: No space left on device`: the service's own words
        (its error code and detail), for the operator's error message."""
        what = self.body.get("detail") or self.body.get("error") or "no detail"
        return f"{self.status} {what}"


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


class UnixJsonClient:
    """Synchronous JSON-over-HTTP client of a Unix socket; the base of every control
    client (gateway/broker tasks, the launcher service). Answers >= 300 raise ControlError."""

    def __init__(self, socket_path: str | os.PathLike[str], timeout: float = 5.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        wait_forever: bool = False,
    ) -> dict[str, Any]:
        # wait_forever: calls whose answer takes as long as the work (a sandbox run)
        conn = _UnixHTTPConnection(self.socket_path, None if wait_forever else self.timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            parsed = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            parsed = {"error": raw[:200].decode("utf-8", "replace")}
        if resp.status >= 300:
            raise ControlError(resp.status, parsed)
        return parsed

    # every control service answers these two
    def health(self) -> dict[str, Any]:
        return self._call("GET", "/v1/health")

    def reload(self) -> dict[str, Any]:
        return self._call("POST", "/v1/reload")


class ControlClient(UnixJsonClient):
    """Synchronous client of a gateway's or broker's control socket."""

    def register(self, task: Task) -> dict[str, Any]:
        return self._call("POST", "/v1/tasks", asdict(task))

    def deregister(self, task_id: str, missing_ok: bool = True) -> dict[str, Any] | None:
        try:
            return self._call("DELETE", f"/v1/tasks/{task_id}")
        except ControlError as e:
            if missing_ok and e.status == 404:
                return None
            raise

    def list(self) -> list[Task]:
        return [Task.from_dict(d) for d in self._call("GET", "/v1/tasks")["tasks"]]
