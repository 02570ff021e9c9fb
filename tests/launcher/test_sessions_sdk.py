"""The SDK's record and stream choices against the real launcher service (container
tier): `Sandbox.record()` / `AsyncSandbox.record()` answer the ended session's signed
record, verified with the host's public key; an exec streams as NDJSON or as server-sent
events, sync and asyncio, with the same chunks and result."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from stockade.client import AsyncSandbox, RecordInvalid, Sandbox, SessionRunning

from . import sessions_rig
from .sessions_rig import Rig

rig = sessions_rig.rig

pytestmark = pytest.mark.netns

ORDER = ("import sys\n"
         "for i in range(3):\n"
         "    print('out', i, flush=True)\n"
         "    print('err', i, file=sys.stderr, flush=True)\n")
JOINED = ("out 0\nout 1\nout 2\n", "err 0\nerr 1\nerr 2\n")


def _pub(rig: Rig) -> Path:
    return Path(str(rig.config.events.chain_dir)) / "signing.pub"


def _split(chunks: list[tuple[str, str]]) -> tuple[str, ...]:
    """Each stream's text in the order it came (reads may join a stream's lines)."""
    return tuple("".join(d for t, d in chunks if t == k) for k in ("stdout", "stderr"))


def test_record_sync(rig: Rig) -> None:
    with Sandbox.create(profile="svc", labels={"agent": "sdk"},
                        launcher=rig.config.launcher.control_socket) as sb:
        assert sb.exec(["true"]).ok
        with pytest.raises(SessionRunning):
            sb.record()
        assert sb.kill()
        rec = sb.record(public_key=_pub(rig))  # waits for the teardown to write it
        assert rec.verified and rec.key_id
        assert rec.task_id == sb.id and rec.ended_by == "killed", rec.record
        assert rec.record["profile"] == "svc"
        plain = sb.record()
        assert not plain.verified and plain.record == rec.record
        with pytest.raises(RecordInvalid):
            sb.record(public_key=Ed25519PrivateKey.generate().public_key())


def test_record_async(rig: Rig) -> None:
    async def go() -> None:
        async with AsyncSandbox.create(
                profile="svc", launcher=rig.config.launcher.control_socket) as sb:
            assert (await sb.exec(["true"])).ok
            with pytest.raises(SessionRunning):
                await sb.record()
            assert await sb.kill()
            rec = await sb.record(public_key=_pub(rig))
            assert rec.verified and rec.task_id == sb.id and rec.ended_by == "killed"
    asyncio.run(go())


@pytest.mark.parametrize("sse", [False, True], ids=["ndjson", "sse"])
def test_stream_formats_sync(rig: Rig, sse: bool) -> None:
    with Sandbox.create(profile="svc", launcher=rig.config.launcher.control_socket) as sb:
        stream = sb.exec(["python3", "-c", ORDER], stream=True, sse=sse)
        chunks = [(c.type, c.data) for c in stream]
        assert _split(chunks) == JOINED and stream.result.exit_code == 0
        whole = sb.exec(["sh", "-c", "echo x; exit 3"], sse=sse)
        assert (whole.stdout, whole.exit_code) == ("x\n", 3)


@pytest.mark.parametrize("sse", [False, True], ids=["ndjson", "sse"])
def test_stream_formats_async(rig: Rig, sse: bool) -> None:
    async def go() -> None:
        async with AsyncSandbox.create(
                profile="svc", launcher=rig.config.launcher.control_socket) as sb:
            stream = await sb.exec(["python3", "-c", ORDER], stream=True, sse=sse)
            chunks = [(c.type, c.data) async for c in stream]
            assert _split(chunks) == JOINED and stream.result.exit_code == 0
    asyncio.run(go())
