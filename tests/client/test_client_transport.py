"""The SDK's transports (Unix socket, TCP + bearer token) and its stream reading, sync and
asyncio, against a tiny aiohttp app that speaks a slice of the contract. Transport only:
what the launcher does with a session is tested against the real service
(test_client_service.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from stockade.client import (
    AsyncClient,
    Client,
    NotFound,
    Sandbox,
    TooLarge,
    TransportError,
    Unauthorized,
)
from stockade.ports import free_port

TOKEN = "s3cret-token"
SESSION = {"session_id": "0123456789", "profile": "p", "isolation": "netns",
           "state": "ready", "created_at": 1.0, "expires_at": 61.0, "labels": {"run": "r1"},
           "execs_running": 0}


def _app(seen: list[web.Request], gate: threading.Event) -> web.Application:
    async def auth(request: web.Request, handler):  # type: ignore[no-untyped-def]
        seen.append(request)
        if request.transport is not None and request.transport.get_extra_info("peername") and \
                request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "unauthorized", "detail": "no token"}, status=401)
        return await handler(request)

    async def create(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({**SESSION, "profile": body["profile"],
                                  "labels": body.get("labels", {})}, status=201)

    async def exec_(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(b'{"type": "stdout", "data": "first\\n"}\n')
        # the client has to see the first chunk before the command goes on
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, 30)
        await resp.write(b'{"type": "stderr", "data": "sec')
        await resp.write(b'ond"}\n{"type": "exit", "exit_code": 0, "ended_by": "exit"}\n')
        return resp

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b'{"type": "stdout", "data": "x"}\n')
        return resp  # ends without the exit line

    async def missing(request: web.Request) -> web.Response:
        return web.json_response({"error": "not_found", "detail": "no session 99"}, status=404)

    async def big(request: web.Request) -> web.Response:
        return web.json_response({"error": "too_large", "detail": "over 1 MiB",
                                  "field": "body"}, status=413)

    async def read(request: web.Request) -> web.Response:
        return web.Response(body=b"\x00\xffraw" + request.query["path"].encode())

    app = web.Application(middlewares=[web.middleware(auth)])
    app.router.add_post("/v1/sessions", create)
    app.router.add_post("/v1/sessions/0123456789/exec", exec_)
    app.router.add_post("/v1/sessions/cut/exec", cut)
    app.router.add_get("/v1/sessions/0123456789/files", read)
    app.router.add_put("/v1/sessions/0123456789/files", big)
    app.router.add_route("*", "/v1/sessions/99", missing)
    app.router.add_delete("/v1/sessions/0123456789", lambda r: web.json_response({"killed": True}))
    return app


class Server:
    def __init__(self, tmp: Path) -> None:
        self.seen: list[web.Request] = []
        self.gate = threading.Event()
        self.socket = str(tmp / "l.sock")
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(30)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(_app(self.seen, self.gate))
        self._loop.run_until_complete(self._runner.setup())
        for site in (web.UnixSite(self._runner, self.socket),
                     web.TCPSite(self._runner, "127.0.0.1", self.port)):
            self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self.gate.set()
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path)
    yield srv
    srv.stop()


def test_unix_socket_session_and_stream(server: Server):
    with Sandbox.create("p", labels={"run": "r1"}, launcher=server.socket) as sb:
        assert (sb.id, sb.info.labels) == ("0123456789", {"run": "r1"})
        stream = sb.exec(["echo"], stream=True)
        it = iter(stream)
        first = next(it)
        assert (first.type, first.data) == ("stdout", "first\n")  # before the rest exists
        server.gate.set()
        assert [(c.type, c.data) for c in it] == [("stderr", "second")]
        assert stream.result.ok and stream.result.stdout == ""  # streamed, not kept
        assert sb.files.read("a.bin") == b"\x00\xffrawa.bin"
        with pytest.raises(TooLarge) as ei:
            sb.files.write("big", b"x" * 10)
        assert ei.value.field == "body" and ei.value.status == 413
    assert [r.method for r in server.seen][-1] == "DELETE"  # killed on exit


def test_whole_result_joins_the_output(server: Server):
    server.gate.set()
    with Client(server.socket) as c:
        res = c.exec("0123456789", ["echo"])
    assert (res.stdout, res.stderr, res.exit_code) == ("first\n", "second", 0)


def test_tcp_with_bearer_token_file(server: Server, tmp_path: Path):
    server.gate.set()
    url = f"http://127.0.0.1:{server.port}"
    with pytest.raises(Unauthorized, match="no token"):
        Sandbox.create("p", launcher=url)
    (tmp_path / "tok").write_text(TOKEN + "\n")
    with Sandbox.create("p", launcher=url, token_file=str(tmp_path / "tok")) as sb:
        assert sb.exec(["x"]).stdout == "first\n"
    assert server.seen[-1].headers["Authorization"] == f"Bearer {TOKEN}"


def test_refusals_and_broken_streams(server: Server, tmp_path: Path):
    with Client(server.socket) as c:
        with pytest.raises(NotFound, match="no session 99"):
            c.get("99")
        assert c.kill("99") is False  # already gone: not an error for a kill
        with pytest.raises(TransportError, match="before its exit line"):
            c.exec("cut", ["x"])
    with pytest.raises(TransportError, match="ConnectError"):
        Client(str(tmp_path / "nothing.sock")).list()
    (tmp_path / "empty").write_text("")
    with pytest.raises(Exception, match="empty"):
        Client("http://127.0.0.1:1", token_file=str(tmp_path / "empty"))


async def test_async_stream_and_context_manager(server: Server):
    from stockade.client import AsyncSandbox

    async with AsyncSandbox.create("p", launcher=server.socket) as sb:
        stream = await sb.exec(["echo"], stream=True)
        got = []
        async for chunk in stream:
            got.append(chunk.data)
            server.gate.set()  # the rest only after the first chunk arrived
        assert got == ["first\n", "second"] and stream.result.exit_code == 0
        with pytest.raises(TooLarge):
            await sb.files.write("big", "x")
    assert server.seen[-1].method == "DELETE"
    async with AsyncClient(f"http://127.0.0.1:{server.port}", token=TOKEN) as c:
        res = await c.exec("0123456789", ["echo"])
        assert json.loads(res.model_dump_json())["stderr"] == "second"
        with pytest.raises(NotFound):
            await c.get("99")
