"""The files routes' memory bound: each upload is held whole in memory before it is
written, so the service moves at most `FILE_TRANSFERS` bodies at once. The routes run
on aiohttp's test server over a fake launcher whose scratch is a tmpfs of the test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from polling import async_wait_until
from stockade.launcher import mounts, session_routes
from stockade.launcher.sessions import new_row

SID = "ab" * 5
UPLOADS = 2 * session_routes.FILE_TRANSFERS
# enough sessions that the service-wide cap, not the per-session one, is what binds
SIDS = [f"{i:02x}" * 5 for i in range(
    -(-session_routes.FILE_TRANSFERS // session_routes.FILE_TRANSFERS_PER_SESSION))]
OTHER = "cd" * 5


@pytest.fixture
def others(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Scratches (tmpfs mounts, as the launcher makes them) of SIDS and of OTHER."""
    roots = {sid: tmp_path / f"scratch-{sid}" for sid in [*SIDS, OTHER]}
    with contextlib.ExitStack() as stack:
        for root in roots.values():
            root.mkdir()
            mounts.mount_tmpfs(str(root), 4 << 20, os.getuid(), os.getgid(), 0o755)
            stack.callback(mounts.umount, str(root))
        yield roots


def _routes(scratch: Path, limit: int = 1 << 20,
            others: dict[str, Path] | None = None) -> session_routes.SessionRoutes:
    """SID's scratch is `scratch`, the others' theirs."""
    roots = {SID: scratch, **(others or {})}
    launcher = SimpleNamespace(
        scratch_root=lambda sid: str(roots[sid]) if sid in roots else None,
        s=SimpleNamespace(sandbox_uid=os.getuid(), sandbox_gid=os.getgid()))
    routes = session_routes.SessionRoutes(SimpleNamespace(launcher=launcher))  # type: ignore[arg-type]
    for sid in roots:
        row = new_row(sid, "p", "container", 0.0, 600, 600, {})
        row.file_limit = limit
        routes.table.add(row)
    return routes


async def _half(gate: asyncio.Event, tail: bytes) -> AsyncIterator[bytes]:
    """A body that sends 1000 bytes, then `tail` once `gate` is set."""
    yield b"a" * 1000
    await gate.wait()
    yield tail


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def test_concurrent_uploads_are_buffered_a_few_at_a_time(
        scratch_tmpfs: Path, others: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """UPLOADS clients, spread over several sessions, each send half a body and hold the
    rest: every request reached its handler, yet at most FILE_TRANSFERS bodies are being
    buffered; once the clients finish, every upload lands whole. (Before the cap all of
    them buffered at once: a few hundred 64 MiB uploads were the host's memory.)"""
    routes = _routes(scratch_tmpfs, others=others)
    entered, reading = [0], [0]
    most = [0]
    real_target, real_read = routes._file_target, session_routes._read_capped

    def target(request: web.Request) -> tuple[str, int]:
        entered[0] += 1
        return real_target(request)

    async def read(request: web.Request, limit: int) -> bytearray | None:
        reading[0] += 1
        most[0] = max(most[0], reading[0])
        try:
            return await real_read(request, limit)
        finally:
            reading[0] -= 1

    monkeypatch.setattr(routes, "_file_target", target)
    monkeypatch.setattr(session_routes, "_read_capped", read)
    app = web.Application()
    routes.add_to(app)
    go = asyncio.Event()

    async with TestClient(TestServer(app)) as client:
        posts = [asyncio.create_task(client.put(
            f"/v1/sessions/{SIDS[i % len(SIDS)]}/files", params={"path": f"d/f{i}"},
            data=_half(go, f"-{i}".encode()))) for i in range(UPLOADS)]
        await asyncio.wait_for(_until(lambda: entered[0] == UPLOADS), 60)
        assert most[0] == session_routes.FILE_TRANSFERS
        go.set()
        answers = await asyncio.wait_for(asyncio.gather(*posts), 60)
        assert [r.status for r in answers] == [200] * UPLOADS
    assert most[0] == session_routes.FILE_TRANSFERS and reading[0] == 0
    assert routes.transfers.sessions() == 0  # no gate kept for sessions with none left
    for i in range(UPLOADS):
        got = (others[SIDS[i % len(SIDS)]] / "d" / f"f{i}").read_bytes()
        assert got == b"a" * 1000 + f"-{i}".encode()


async def test_one_sessions_stalled_uploads_leave_other_sessions_a_place(
        scratch_tmpfs: Path, others: dict[str, Path]) -> None:
    """One session's FILE_TRANSFERS uploads that send half a body and stall hold only
    FILE_TRANSFERS_PER_SESSION places: another session's upload lands meanwhile (before,
    the first session's held every place of the service until its bodies timed out)."""
    other = OTHER
    routes = _routes(scratch_tmpfs, others=others)
    app = web.Application()
    routes.add_to(app)
    go = asyncio.Event()
    async with TestClient(TestServer(app)) as client:
        stuck = [asyncio.create_task(client.put(
            f"/v1/sessions/{SID}/files", params={"path": f"h{i}"}, data=_half(go, b"-end")))
            for i in range(session_routes.FILE_TRANSFERS)]
        await asyncio.sleep(0.3)  # every held upload reached the routes
        ok = await asyncio.wait_for(client.put(
            f"/v1/sessions/{other}/files", params={"path": "x"}, data=b"fine"), 10)
        assert ok.status == 200
        assert not any(t.done() for t in stuck)
        go.set()
        answers = await asyncio.wait_for(asyncio.gather(*stuck), 60)
    assert [r.status for r in answers] == [200] * session_routes.FILE_TRANSFERS
    assert (others[other] / "x").read_bytes() == b"fine"
    for i in range(session_routes.FILE_TRANSFERS):
        assert (scratch_tmpfs / f"h{i}").read_bytes() == b"a" * 1000 + b"-end"


async def test_a_stalled_body_gives_its_place_back(
        scratch_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FILE_TRANSFERS clients that send a little and then nothing: each is refused (408)
    once its body has been idle FILE_BODY_IDLE_S, nothing of it is written, and the next
    upload gets a place (before, the stalled ones held every place for ever)."""
    monkeypatch.setattr(session_routes, "FILE_BODY_IDLE_S", 0.2)
    app = web.Application()
    _routes(scratch_tmpfs).add_to(app)
    never = asyncio.Event()
    async with TestClient(TestServer(app)) as client:
        url = f"/v1/sessions/{SID}/files"
        stuck = [asyncio.create_task(client.put(url, params={"path": f"s{i}"},
                                                data=_half(never, b"never sent")))
                 for i in range(session_routes.FILE_TRANSFERS)]
        answers = await asyncio.wait_for(asyncio.gather(*stuck), 60)
        assert [r.status for r in answers] == [408] * session_routes.FILE_TRANSFERS
        assert {(await r.json())["field"] for r in answers} == {"body"}
        ok = await asyncio.wait_for(client.put(url, params={"path": "after"},
                                               data=b"fine"), 60)
        assert ok.status == 200
        never.set()
    assert sorted(p.name for p in scratch_tmpfs.iterdir()) == ["after"]


def _stalled_get(port: int, path: str) -> socket.socket:
    """A GET whose client then reads nothing (a receive buffer of a few KiB)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /v1/sessions/{SID}/files?path={path} HTTP/1.1\r\n"
                 "Host: x\r\n\r\n".encode())
    return sock


def _drain(sock: socket.socket) -> int:
    """Bytes received until the server closes the connection (a reset counts)."""
    sock.settimeout(30)
    n = 0
    try:
        while chunk := sock.recv(1 << 20):
            n += len(chunk)
    except ConnectionResetError:
        pass
    sock.close()
    return n


async def test_a_stalled_reader_is_cut_off(
        scratch_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A response is held in memory until it is sent, so its place is kept until then: a
    client that takes none of it for FILE_BODY_IDLE_S is cut off with part of the file,
    and the next GET gets a place. (Before, the body went to the transport's buffer
    whole and stayed there for a client that never read: one 64 MiB file per request.)"""
    monkeypatch.setattr(session_routes, "FILE_BODY_IDLE_S", 0.2)
    size = 12 << 20
    (scratch_tmpfs / "big").write_bytes(b"b" * size)
    (scratch_tmpfs / "small").write_bytes(b"s")
    app = web.Application()
    routes = _routes(scratch_tmpfs, limit=size)
    routes.add_to(app)
    async with TestClient(TestServer(app)) as client:
        port = client.server.port
        assert port is not None
        socks = [_stalled_get(port, "big") for _ in range(session_routes.FILE_TRANSFERS)]
        ok = await asyncio.wait_for(client.get(f"/v1/sessions/{SID}/files",
                                               params={"path": "small"}), 60)
        assert ok.status == 200 and await ok.read() == b"s"
        # every stalled GET cut off before any is read: a loaded host may answer the small
        # GET while a stalled one still waits for its place (two per session), and reading
        # it then would let it finish whole
        await async_wait_until(lambda: not routes.transfers.sessions(), 30,
                               what="a stalled GET was never cut off")
        got = await asyncio.gather(*(asyncio.to_thread(_drain, s) for s in socks))
    assert all(0 < n < size for n in got), got
