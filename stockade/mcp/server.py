"""The MCP wiring: `tools.SessionTools` as FastMCP tools, served over stdio or streamable
HTTP. The HTTP transport binds to loopback unless told otherwise, and then only with a
bearer token (`--token-file`): anyone who reaches it can run code in sandboxes."""

from __future__ import annotations

import asyncio
import hmac
import signal
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from mcp.server.fastmcp import FastMCP
from mcp.server.fastmcp.exceptions import ToolError

from stockade.client import AsyncClient

from .tools import ExecOutput, SessionRow, SessionTools, ToolFailure

INSTRUCTIONS = (
    "Run code in Stockade sandboxes: default-deny network (only the allowed registries "
    "and APIs of the sandbox's profile), a scratch directory as the working directory. "
    "Name a session to keep files and state between calls; every result lists what the "
    "fence denied (reason and destination).")

Scope = dict[str, Any]
ASGI = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                Awaitable[None]]


async def _tool(coro: Awaitable[Any]) -> Any:
    try:
        return await coro
    except ToolFailure as e:
        raise ToolError(str(e)) from None


def build(tools: SessionTools, *, host: str = "127.0.0.1", port: int = 8000) -> FastMCP:
    # no FastMCP lifespan for the clean-up: over HTTP it runs per MCP client session,
    # and the sessions here are the server's, shared by its clients (`serve` ends them)
    app = FastMCP("stockade", instructions=INSTRUCTIONS, host=host, port=port)

    @app.tool()
    async def run_code(code: str, language: Literal["python", "shell"] = "python",
                       session: str | None = None, profile: str | None = None,
                       timeout_s: float | None = None) -> ExecOutput:
        """Run Python or shell code. Without `session`: in a fresh sandbox, killed right
        after. With `session`: in that named session (created on first use), so files
        and installed packages stay for the next call."""
        return await _tool(tools.run_code(code, language, session, profile, timeout_s))

    @app.tool(name="exec")
    async def exec_(session: str, argv: list[str], stdin: str | None = None,
                    cwd: str | None = None, timeout_s: float | None = None) -> ExecOutput:
        """Run a command (argv, no shell) in a session; cwd is relative to its scratch."""
        return await _tool(tools.exec(session, argv, stdin, cwd, timeout_s))

    @app.tool()
    async def create_session(name: str, profile: str | None = None,
                             labels: dict[str, str] | None = None) -> SessionRow:
        """Start a named session (a sandbox kept until killed or its TTL)."""
        return await _tool(tools.create_session(name, profile, labels))

    @app.tool()
    async def write_file(session: str, path: str, content: str) -> dict[str, Any]:
        """Write a UTF-8 text file under the session's scratch (path relative to it)."""
        return await _tool(tools.write_file(session, path, content))  # type: ignore[no-any-return]

    @app.tool()
    async def read_file(session: str, path: str) -> dict[str, Any]:
        """Read a file under the session's scratch (bytes that are not UTF-8: U+FFFD)."""
        return await _tool(tools.read_file(session, path))  # type: ignore[no-any-return]

    @app.tool()
    async def list_sessions() -> list[SessionRow]:
        """The launcher's sessions, with the names this server gave them."""
        return await _tool(tools.list_sessions())  # type: ignore[no-any-return]

    @app.tool()
    async def kill(session: str) -> dict[str, Any]:
        """Kill a session and remove its sandbox."""
        return await _tool(tools.kill(session))  # type: ignore[no-any-return]

    return app


class BearerGuard:
    """ASGI middleware: HTTP requests without `Authorization: Bearer <token>` get 401
    (constant-time comparison)."""

    def __init__(self, app: ASGI, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body",
                            "body": b'{"error": "unauthorized", "detail": "bearer token"}'})
                return
        await self.app(scope, receive, send)


async def serve_http(app: FastMCP, token: str | None) -> None:
    import uvicorn

    asgi: Any = app.streamable_http_app()
    if token is not None:
        asgi = BearerGuard(asgi, token)
    config = uvicorn.Config(asgi, host=app.settings.host, port=app.settings.port,
                            log_level="warning", lifespan="on")
    await uvicorn.Server(config).serve()


async def serve(client: AsyncClient, *, transport: Literal["stdio", "http"],
                profile: str | None, ttl_s: int | None, host: str, port: int,
                token: str | None) -> None:
    """Until the transport ends (stdin closed, uvicorn stopped) or SIGTERM/SIGINT; then
    the sessions this server created are killed."""
    tools = SessionTools(client, profile=profile, ttl_s=ttl_s)
    app = build(tools, host=host, port=port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # a flag, not a cancel: uvicorn hands the signal on once it has shut down, and
        # the clean-up below must not be cancelled by it
        loop.add_signal_handler(sig, stop.set)
    main = asyncio.create_task(app.run_stdio_async() if transport == "stdio"
                               else serve_http(app, token))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({main, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (main, stopping):
            t.cancel()
        await asyncio.gather(main, stopping, return_exceptions=True)
        await tools.close()
        await client.aclose()
    if not main.cancelled() and main.exception() is not None:
        raise main.exception()  # type: ignore[misc]  # the transport's own failure
