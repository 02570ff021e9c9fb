"""The Vault client against a real OpenBao: AppRole, renewal, re-auth, cache, rotation, outage.

Time is a fake clock passed to the client (cache TTL, stale window, token age), so no
test sleeps or asserts on timing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import uuid
from pathlib import Path

import pytest
from stockade.broker.settings import AppRoleSettings, VaultSettings
from stockade.broker.vault import VaultClient, VaultUnavailable
from stockade.policy.model import CredentialSource

from stockade.testing.devvault import DevOpenBao, free_port

from .conftest import Upstream, assert_no_secret, start_harness, stop_harness

pytestmark = pytest.mark.vault


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def cred(path: str) -> CredentialSource:
    return CredentialSource("secret", path, "token")


async def test_single_flight_100_concurrent_reads(bao: DevOpenBao) -> None:
    path = "stockade/sf-" + uuid.uuid4().hex[:8]
    bao.put_secret(path, "token", "v-one")
    v = VaultClient(VaultSettings(address=bao.address), token=bao.root_token)
    try:
        got = await asyncio.gather(*(v.get(cred(path)) for _ in range(100)))
        assert {g.value for g in got} == {"v-one"} and {g.version for g in got} == {1}
        assert v.reads == 1
        await v.get(cred(path))
        assert v.reads == 1  # cached
        assert "v-one" not in repr(got[0])
    finally:
        await v.close()


@pytest.mark.parametrize("wrapped", [False, True])
async def test_approle_login_renewal_and_reauth(
    bao: DevOpenBao, tmp_path: Path, wrapped: bool
) -> None:
    path = "stockade/ar-" + uuid.uuid4().hex[:8]
    bao.put_secret(path, "token", "approle-value-1")
    role = "broker-" + uuid.uuid4().hex[:6]
    role_id, secret_id = bao.setup_approle(role, token_ttl="60s", token_max_ttl="1h")
    (tmp_path / "role_id").write_text(role_id + "\n")
    (tmp_path / "secret_id").write_text(bao.wrapped_secret_id(role) if wrapped else secret_id)
    settings = VaultSettings(
        address=bao.address,
        approle=AppRoleSettings(role_id_file=str(tmp_path / "role_id"),
                                secret_id_file=str(tmp_path / "secret_id"),
                                secret_id_wrapped=wrapped),
    )
    clock = FakeClock()
    v = VaultClient(settings, cache_ttl_s=10, clock=clock)
    try:
        await v.start()
        assert v.logins == 1
        assert (await v.get(cred(path))).value == "approle-value-1"
        # not yet due: no renewal
        await v.renew_now()
        assert v.renewals == 0
        clock.advance(45)  # 3/4 of the 60 s lease gone
        await v.renew_now()
        assert v.renewals == 1 and v.logins == 1
        ttl = bao.client().auth.token.lookup(v._client.token)["data"]["ttl"]
        assert ttl > 45
        # the token is revoked behind the broker's back: a 403 triggers a fresh login
        bao.client().auth.token.revoke(v._client.token)
        clock.advance(11)  # past the cache TTL
        assert (await v.get(cred(path))).value == "approle-value-1"
        assert v.logins == 2
    finally:
        await v.close()


async def test_policy_denied_path_fails_closed(bao: DevOpenBao, tmp_path: Path) -> None:
    role = "narrow-" + uuid.uuid4().hex[:6]
    role_id, secret_id = bao.setup_approle(role, policy_paths=("secret/data/only/*",))
    (tmp_path / "r").write_text(role_id)
    (tmp_path / "s").write_text(secret_id)
    bao.put_secret("stockade/other", "token", "nope-value")
    v = VaultClient(VaultSettings(address=bao.address, approle=AppRoleSettings(
        role_id_file=str(tmp_path / "r"), secret_id_file=str(tmp_path / "s"))))
    try:
        with pytest.raises(VaultUnavailable) as ei:
            await v.get(cred("stockade/other"))
        assert str(ei.value) == "credential store unavailable"
        with pytest.raises(VaultUnavailable):
            await v.get(cred("stockade/missing-" + uuid.uuid4().hex))
    finally:
        await v.close()


async def test_rotation_used_within_cache_ttl(
    bao: DevOpenBao, upstream: Upstream, tls: tuple[ssl.SSLContext, str], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    clock = FakeClock()
    h, runner = await start_harness(tmp_path, bao, upstream, tls[1], clock=clock, ttl=30)
    old = h.secret
    new = "sk-rotated-" + uuid.uuid4().hex
    try:
        status, doc = await h.v1({"api": "echo", "path": "/json"})
        assert status == 200
        assert ["Authorization", f"Bearer {old}"] in upstream.seen[-1]["headers"]
        assert bao.put_secret(h.secret_path, "token", new) == 2
        clock.advance(10)  # inside the TTL: still the cached version
        await h.v1({"api": "echo", "path": "/json"})
        assert ["Authorization", f"Bearer {old}"] in upstream.seen[-1]["headers"]
        clock.advance(21)  # TTL passed: the rotated version is read and used
        status, doc = await h.v1({"api": "echo", "path": "/json"})
        assert status == 200
        assert ["Authorization", f"Bearer {new}"] in upstream.seen[-1]["headers"]
        assert new not in doc["body"] and "[REDACTED]" in doc["body"]
        assert h.vault.reads == 2
    finally:
        await stop_harness(h, runner)
    blobs = [*h.produced, h.events_path.read_bytes(), caplog.text.encode()]
    assert_no_secret(old, blobs)
    assert_no_secret(new, blobs)


async def test_vault_stopped_serves_stale_then_503(
    upstream: Upstream, tls: tuple[ssl.SSLContext, str], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    clock = FakeClock()
    own = DevOpenBao().start()
    try:
        h, runner = await start_harness(tmp_path, own, upstream, tls[1], clock=clock,
                                        ttl=10, stale=20)
        try:
            assert (await h.v1({"api": "echo", "path": "/json"}))[0] == 200
            own.stop()  # Vault goes away mid-test
            clock.advance(15)  # cache expired, inside the stale window
            status, doc = await h.v1({"api": "echo", "path": "/json"})
            assert status == 200 and doc["status"] == 200
            assert ["Authorization", f"Bearer {h.secret}"] in upstream.seen[-1]["headers"]
            clock.advance(20)  # past TTL + stale: fail closed
            status, _hdr, body = await h.call("GET", "/echo/json")
            assert status == 503
            answer = json.loads(body)
            assert answer == {"error": "denied", "reason": "vault_unavailable",
                              "message": "credential store unavailable"}
            port = own.address.rsplit(":", 1)[1]
            for needle in (port.encode(), b"127.0.0.1:", b"hvac", b"Traceback",
                           b"Connection", b"secret/data"):
                assert needle not in body
            evs = h.event_list()
            status_evs = [e for e in evs if e["event"]["action"] == "vault_status"]
            calls = [e for e in evs if e["event"]["action"] == "broker_call"]
            assert calls[-1]["event"]["reason"] == "vault_unavailable"
            assert [e["event"]["reason"] for e in status_evs] == ["vault_unavailable"]
            assert "ConnectionError" in status_evs[0]["message"]  # class name only
            metrics = h.broker.metrics.render().decode()
            assert 'stockade_broker_secret_cache_total{result="stale"} 1.0' in metrics
            assert "stockade_broker_vault_up 0.0" in metrics
        finally:
            await stop_harness(h, runner)
        assert_no_secret(h.secret, [*h.produced, h.events_path.read_bytes(),
                                    caplog.text.encode()])
        assert own.address.encode() not in h.events_path.read_bytes()
    finally:
        own.stop()
    assert not own.running


async def test_vault_down_at_start_then_up() -> None:
    later = DevOpenBao(port=free_port())
    settings = VaultSettings(address=f"http://127.0.0.1:{later.port}", timeout_s=2)
    v = VaultClient(settings, token=later.root_token)
    try:
        assert await v.ensure_login() is False
        with pytest.raises(VaultUnavailable) as ei:
            await v.get(cred("stockade/late"))
        assert str(ei.value) == "credential store unavailable"
        assert str(later.port) not in repr(ei.value) + str(ei.value)
        with later:
            later.put_secret("stockade/late", "token", "late-value")
            assert (await v.get(cred("stockade/late"))).value == "late-value"
            assert v.logins == 1 and v.status()["vault_up"] is True
    finally:
        await v.close()
