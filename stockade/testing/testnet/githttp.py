"""git's smart HTTP protocol on the fake internet: aiohttp in front of `git http-backend`.

`git http-backend` is a CGI program; neither aiohttp nor the standard library runs CGI
from an asyncio server (http.server's CGI handler is synchronous and deprecated), so the
bridge is hand-written: `cgi_environ` and `parse_cgi_head` are pure, the handler only
moves bytes between the request, the child process and the response, streaming both
ways. Read-only: the repositories refuse pushes (`http.receivepack false`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from aiohttp import web
from multidict import CIMultiDict

from stockade.testing.testnet.gitrepo import git_env

GIT_ROUTE = r"/{path:[^/]+\.git/.*}"  # /<repo>.git/<info/refs | git-upload-pack | ...>
_CHUNK = 64 * 1024
_MAX_HEAD = 64 * 1024
# not copied from the CGI head: aiohttp frames the response itself
_HOP_BY_HOP = frozenset({"connection", "transfer-encoding", "keep-alive"})


def cgi_environ(
    *,
    method: str,
    path_info: str,
    query: str,
    headers: Mapping[str, str],
    project_root: str,
    remote_addr: str,
    body_decoded: bool,
) -> dict[str, str]:
    """The CGI variables (RFC 3875) for one request, without the process environment.

    `body_decoded`: the server already undid the body's Content-Encoding (aiohttp does by
    default), so neither the encoding nor the wire length may reach the backend; it then
    reads the body to end of file."""
    env = {
        "GATEWAY_INTERFACE": "CGI/1.1",
        "GIT_PROJECT_ROOT": project_root,
        "GIT_HTTP_EXPORT_ALL": "1",
        "REQUEST_METHOD": method,
        "PATH_INFO": path_info,
        "QUERY_STRING": query,
        "REMOTE_ADDR": remote_addr,
        "SERVER_PROTOCOL": "HTTP/1.1",
    }
    if "Content-Type" in headers:
        env["CONTENT_TYPE"] = headers["Content-Type"]
    if "Content-Length" in headers and not body_decoded:
        env["CONTENT_LENGTH"] = headers["Content-Length"]
    for name, value in headers.items():
        key = "HTTP_" + name.upper().replace("-", "_")
        if name.lower() in ("content-type", "content-length", "authorization", "proxy"):
            continue  # CGI carries these differently, or never (httpoxy)
        if body_decoded and key == "HTTP_CONTENT_ENCODING":
            continue
        env[key] = value
    if "Git-Protocol" in headers:
        env["GIT_PROTOCOL"] = headers["Git-Protocol"]  # protocol v2, as git's docs configure
    return env


def parse_cgi_head(head: bytes) -> tuple[int, CIMultiDict[str]]:
    """Status and headers of a CGI response head (the bytes before the blank line)."""
    status = 200
    headers: CIMultiDict[str] = CIMultiDict()
    for raw in head.replace(b"\r\n", b"\n").split(b"\n"):
        if not raw:
            continue
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or not name.strip():
            raise ValueError(f"bad CGI header line {raw!r}")
        name, value = name.strip(), value.strip()
        if name.lower() == "status":
            status = int(value.split()[0])
        elif name.lower() not in _HOP_BY_HOP:
            headers.add(name, value)
    return status, headers


async def _read_head(out: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, start of body): read until the blank line ending the CGI head."""
    buf = b""
    while True:
        for sep in (b"\r\n\r\n", b"\n\n"):
            head, found, rest = buf.partition(sep)
            if found:
                return head, rest
        if len(buf) > _MAX_HEAD:
            raise ValueError("CGI head too long")
        chunk = await out.read(_CHUNK)
        if not chunk:
            raise ValueError("CGI program ended before its head")
        buf += chunk


async def _feed(req: web.Request, stdin: asyncio.StreamWriter) -> None:
    try:
        async for chunk in req.content.iter_chunked(_CHUNK):
            stdin.write(chunk)
            await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the backend stopped reading: its answer says why
    finally:
        stdin.close()


def git_handler(project_root: Path) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The aiohttp handler serving every repository under `project_root`."""
    base_env = git_env(project_root)

    async def handler(req: web.Request) -> web.StreamResponse:
        env = base_env | cgi_environ(
            method=req.method,
            path_info=req.path,
            query=req.query_string,
            headers=req.headers,
            project_root=str(project_root),
            remote_addr=req.remote or "",
            body_decoded=True,
        )
        proc = await asyncio.create_subprocess_exec(
            "git", "http-backend", env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        feeder = asyncio.create_task(_feed(req, proc.stdin))
        try:
            head, rest = await _read_head(proc.stdout)
            status, headers = parse_cgi_head(head)
            resp = web.StreamResponse(status=status, headers=headers)
            await resp.prepare(req)
            if rest:
                await resp.write(rest)
            while chunk := await proc.stdout.read(_CHUNK):
                await resp.write(chunk)
            await resp.write_eof()
            await proc.wait()
            return resp
        finally:
            feeder.cancel()
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()

    return handler


def add_git_routes(app: web.Application, project_root: Path) -> None:
    handler = git_handler(project_root)
    app.router.add_get(GIT_ROUTE, handler)
    app.router.add_post(GIT_ROUTE, handler)
