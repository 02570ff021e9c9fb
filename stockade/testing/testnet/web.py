"""The fake internet's HTTP(S) sites (aiohttp applications, one per name).

Every site answers `/`, `/echo`, `/bytes/<n>` and `/upload`; `echo.test` echoes every
path, `pypi.test` adds a PEP 503 index, `api.test` a demo API that checks a key and
`git.test` git's smart HTTP protocol (`githttp`).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from stockade.testing.testnet.githttp import add_git_routes
from stockade.testing.testnet.wheel import Wheel, normalize, project_page, root_index

MAX_BYTES = 1 << 30  # /bytes/<n> upper bound (1 GiB)
MAX_ECHO_BODY = 1 << 20  # echo reads at most this much body
_CHUNK = 64 * 1024
_BLOCK = bytes(range(256)) * (_CHUNK // 256)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def echo_document(host: str, req: web.Request, body: bytes) -> dict[str, Any]:
    """What the echo endpoints return: the request as the server saw it."""
    headers: dict[str, str] = {}
    for k, v in req.headers.items():
        headers[k] = f"{headers[k]}, {v}" if k in headers else v
    args: dict[str, list[str]] = {}
    for k, v in req.query.items():
        args.setdefault(k, []).append(v)
    return {
        "host": host,
        "method": req.method,
        "path": req.path,
        "query": req.query_string,
        "args": args,
        "headers": headers,
        "body": body.decode("utf-8", errors="replace"),
        "body_base64": base64.b64encode(body).decode(),
        "body_size": len(body),
        "scheme": req.scheme,
        "http_version": f"{req.version.major}.{req.version.minor}",
    }


async def _read_capped(req: web.Request) -> bytes:
    body = await req.content.read(MAX_ECHO_BODY + 1)
    if len(body) > MAX_ECHO_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_ECHO_BODY, actual_size=len(body))
    return body


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, sort_keys=True) + "\n", status=status, content_type="application/json"
    )


def _echo(host: str) -> Handler:
    async def handler(req: web.Request) -> web.StreamResponse:
        return _json(echo_document(host, req, await _read_capped(req)))

    return handler


def _index(host: str) -> Handler:
    async def handler(req: web.Request) -> web.StreamResponse:
        return web.Response(text=f"Hello from {host} (stockade fake internet)\n")

    return handler


async def _bytes(req: web.Request) -> web.StreamResponse:
    try:
        n = int(req.match_info["n"])
    except ValueError:
        raise web.HTTPBadRequest(text="n must be an integer\n") from None
    if not 0 <= n <= MAX_BYTES:
        raise web.HTTPBadRequest(text=f"n must be between 0 and {MAX_BYTES}\n")
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = n
    await resp.prepare(req)
    left = n
    while left:
        chunk = _BLOCK[: min(left, _CHUNK)]
        await resp.write(chunk)
        left -= len(chunk)
    await resp.write_eof()
    return resp


async def _upload(req: web.Request) -> web.StreamResponse:
    # count without buffering, so uploads can be as large as a bench wants
    total = 0
    async for chunk in req.content.iter_chunked(_CHUNK):
        total += len(chunk)
    return _json({"received": total})


def _common_routes(app: web.Application, host: str) -> None:
    app.router.add_get("/", _index(host))
    app.router.add_route("*", "/echo", _echo(host))
    app.router.add_get("/bytes/{n}", _bytes)
    app.router.add_post("/upload", _upload)


def _pypi_routes(app: web.Application, wheels: list[Wheel]) -> None:
    by_name = {w.filename: w for w in wheels}

    async def simple(req: web.Request) -> web.StreamResponse:
        return web.Response(text=root_index(wheels), content_type="text/html")

    async def project(req: web.Request) -> web.StreamResponse:
        name = req.match_info["project"]
        if name != normalize(name):
            raise web.HTTPMovedPermanently(f"/simple/{normalize(name)}/")
        page = project_page(name, wheels)
        if page is None:
            raise web.HTTPNotFound(text=f"no project {name}\n")
        return web.Response(text=page, content_type="text/html")

    async def package(req: web.Request) -> web.StreamResponse:
        wheel = by_name.get(req.match_info["filename"])
        if wheel is None:
            raise web.HTTPNotFound()
        return web.Response(body=wheel.data, content_type="application/octet-stream")

    app.router.add_get("/simple", simple)
    app.router.add_get("/simple/", simple)
    app.router.add_get("/simple/{project}", project)
    app.router.add_get("/simple/{project}/", project)
    app.router.add_get("/packages/{filename}", package)


def _key_ok(presented: str | None, api_key: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), api_key.encode())


def _bearer(req: web.Request) -> str | None:
    auth = req.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _basic_password(req: web.Request) -> str | None:
    auth = req.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        _, _, password = base64.b64decode(token.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return password


def _api_routes(app: web.Application, api_key: str) -> None:
    def whoami(extract: Callable[[web.Request], str | None], how: str) -> Handler:
        async def handler(req: web.Request) -> web.StreamResponse:
            if not _key_ok(extract(req), api_key):
                # never echo what was presented: the 401 must not help a key leak
                return _json({"error": "unauthorized", "expected": how}, status=401)
            return _json({"user": "demo"})

        return handler

    app.router.add_get("/v1/whoami", whoami(_bearer, "Authorization: Bearer <key>"))
    app.router.add_get(
        "/v1/whoami-header", whoami(lambda r: r.headers.get("X-Api-Key"), "X-Api-Key: <key>")
    )
    app.router.add_get("/v1/whoami-query", whoami(lambda r: r.query.get("key"), "?key=<key>"))
    app.router.add_get("/v1/whoami-basic", whoami(_basic_password, "basic auth password"))
    app.router.add_route("*", "/v1/echo", _echo("api.test"))
    app.router.add_route("*", "/v1/echo/{tail:.*}", _echo("api.test"))


def make_app(
    host: str,
    *,
    api_key: str = "",
    wheels: list[Wheel] | None = None,
    git_root: str | None = None,
) -> web.Application:
    """The site for one name. `api_key` matters for api.test, `wheels` for pypi.test,
    `git_root` (a directory of bare repositories) for git.test."""
    app = web.Application(client_max_size=MAX_ECHO_BODY)
    if host == "echo.test":
        app.router.add_get("/bytes/{n}", _bytes)
        app.router.add_post("/upload", _upload)
        app.router.add_route("*", "/{tail:.*}", _echo(host))
        return app
    _common_routes(app, host)
    if host == "pypi.test":
        _pypi_routes(app, wheels or [])
    if host == "api.test":
        if not api_key:
            raise ValueError("api.test needs an api_key")
        _api_routes(app, api_key)
    if host == "git.test":
        if not git_root:
            raise ValueError("git.test needs a git_root")
        add_git_routes(app, Path(git_root))
    return app
