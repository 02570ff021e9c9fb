"""The fake sites over real sockets on 127.0.0.1 (aiohttp test server, no namespace)."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer

from stockade.testing.testnet.web import MAX_BYTES, make_app
from stockade.testing.testnet.wheel import build_wheel

KEY = "sk-test-web-secret"
Make = Callable[[str], Awaitable[TestClient]]


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture
async def site() -> AsyncIterator[Make]:
    clients: list[TestClient] = []

    async def make(host: str) -> TestClient:
        app = make_app(host, api_key=KEY, wheels=[build_wheel()])
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.close()


async def test_index_names_the_host(site: Make) -> None:
    c = await site("allowed.test")
    r = await c.get("/")
    assert r.status == 200
    assert "allowed.test" in await r.text()


async def test_echo_reports_the_request(site: Make) -> None:
    c = await site("other.test")
    r = await c.put("/echo?a=1&a=2&b=x", data=b"payload", headers={"X-Thing": "v"})
    doc = await r.json()
    assert doc["method"] == "PUT"
    assert doc["path"] == "/echo"
    assert doc["query"] == "a=1&a=2&b=x"
    assert doc["args"] == {"a": ["1", "2"], "b": ["x"]}
    assert doc["headers"]["X-Thing"] == "v"
    assert doc["body"] == "payload"
    assert base64.b64decode(doc["body_base64"]) == b"payload"


async def test_echo_host_echoes_every_path(site: Make) -> None:
    c = await site("echo.test")
    r = await c.delete("/any/where?q=1")
    doc = await r.json()
    assert (doc["method"], doc["path"], doc["query"]) == ("DELETE", "/any/where", "q=1")


async def test_non_echo_host_has_no_catch_all(site: Make) -> None:
    c = await site("allowed.test")
    assert (await c.get("/any/where")).status == 404


async def test_bytes_streams_exactly_n(site: Make) -> None:
    c = await site("allowed.test")
    r = await c.get("/bytes/200000")
    body = await r.read()
    assert len(body) == 200000
    assert r.headers["Content-Length"] == "200000"
    assert (await c.get(f"/bytes/{MAX_BYTES + 1}")).status == 400
    assert (await c.get("/bytes/-1")).status == 400
    assert (await c.get("/bytes/abc")).status == 400


async def test_upload_counts_bytes(site: Make) -> None:
    c = await site("allowed.test")
    r = await c.post("/upload", data=b"x" * 3_000_000)
    assert await r.json() == {"received": 3_000_000}


async def test_pypi_index_serves_the_wheel(site: Make) -> None:
    c = await site("pypi.test")
    assert "stockade-demo-pkg" in await (await c.get("/simple/")).text()
    page = await (await c.get("/simple/stockade-demo-pkg/")).text()
    w = build_wheel()
    assert f"#sha256={w.sha256}" in page
    r = await c.get(f"/packages/{w.filename}")
    assert hashlib.sha256(await r.read()).hexdigest() == w.sha256
    assert (await c.get("/simple/no-such-project/")).status == 404
    moved = await c.get("/simple/Stockade_Demo_Pkg/", allow_redirects=False)
    assert moved.status == 301
    assert moved.headers["Location"] == "/simple/stockade-demo-pkg/"


@pytest.mark.parametrize(
    ("path", "good", "bad"),
    [
        ("/v1/whoami", {"headers": {"Authorization": f"Bearer {KEY}"}},
         {"headers": {"Authorization": "Bearer nope"}}),
        ("/v1/whoami-header", {"headers": {"X-Api-Key": KEY}}, {"headers": {"X-Api-Key": "x"}}),
        ("/v1/whoami-query", {"params": {"key": KEY}}, {"params": {"key": "x"}}),
        ("/v1/whoami-basic", {"headers": {"Authorization": _basic("u", KEY)}},
         {"headers": {"Authorization": _basic("u", "x")}}),
    ],
)
async def test_api_key_forms(site: Make, path: str, good: dict, bad: dict) -> None:
    c = await site("api.test")
    ok = await c.get(path, **good)
    assert ok.status == 200
    assert await ok.json() == {"user": "demo"}
    for kw in (bad, {}):
        denied = await c.get(path, **kw)
        assert denied.status == 401
        assert KEY not in await denied.text()


async def test_api_echo_reflects_injected_key(site: Make) -> None:
    c = await site("api.test")
    r = await c.post("/v1/echo/deeper", headers={"Authorization": f"Bearer {KEY}"}, data=b"{}")
    doc = await r.json()
    assert doc["headers"]["Authorization"] == f"Bearer {KEY}"
    assert doc["path"] == "/v1/echo/deeper"


def test_api_site_needs_a_key() -> None:
    with pytest.raises(ValueError):
        make_app("api.test", api_key="")
