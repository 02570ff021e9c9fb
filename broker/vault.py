"""The broker's Vault/OpenBao client: authentication, token renewal, a KV v2 cache.

hvac does the protocol; this module adds what the broker needs around it: AppRole,
Kubernetes (`vault_k8s.py`) or token auth with renewal before expiry and re-login on 403,
a per-secret cache with a TTL, single-flight reads (N concurrent callers cause one Vault
read), serve-stale for a bounded time when Vault fails, then fail closed. hvac is
synchronous, so every call runs in a small thread pool. hvac exceptions carry URLs and
response bodies: they are reduced to their class name here and never leave this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import hvac
import hvac.exceptions
from stockade.policy.model import CredentialSource

from .secretvalue import SecretValue, VaultUnavailable
from .settings import VaultSettings
from .vault_k8s import KubernetesLoginError, kubernetes_login

log = logging.getLogger("stockade.broker.vault")
T = TypeVar("T")


class _Missing(Exception):
    """The secret, its field, or its latest version does not exist (never served stale)."""


CacheKey = tuple[str, str, str]
StatusFn = Callable[[str, str], None]  # (state "up"/"down", cause)


class VaultClient:
    """`await start()`, then `await get(credential)`; `await close()` at the end."""

    def __init__(
        self,
        settings: VaultSettings,
        *,
        cache_ttl_s: float = 60.0,
        serve_stale_s: float = 300.0,
        token: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_status: StatusFn | None = None,
        on_read: Callable[[float, bool], None] | None = None,  # (seconds, ok) -> metrics
        on_cache: Callable[[str], None] | None = None,  # "hit" | "miss" | "stale"
    ) -> None:
        if not settings.address:
            raise ValueError("vault.address is not set")
        self.settings = settings
        self.cache_ttl_s = cache_ttl_s
        self.serve_stale_s = serve_stale_s
        self._explicit_token = token
        self.clock = clock
        self.on_status = on_status
        self.on_read = on_read
        self.on_cache = on_cache
        self._verify: bool | str = settings.ca_file or True
        self._client = hvac.Client(
            url=settings.address, timeout=settings.timeout_s, verify=self._verify
        )
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="stockade-vault")
        self._cache: dict[CacheKey, SecretValue] = {}
        self._inflight: dict[CacheKey, asyncio.Future[SecretValue]] = {}
        self._secret_id: str | None = None  # unwrapped once, kept for re-login
        self._lease_s = 0.0  # 0 = no expiry (root / periodic without ttl)
        self._renewable = False
        self._token_at = 0.0
        self._renew_task: asyncio.Task[None] | None = None
        self._up = True
        # counters for tests, metrics and `status()`
        self.reads = 0
        self.logins = 0
        self.renewals = 0

    # -- thread-pool plumbing ----------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    # -- authentication ------------------------------------------------------------------
    def _login_sync(self) -> None:
        s = self.settings
        mode = s.auth_mode
        if self._explicit_token is not None or mode == "token":
            token = self._explicit_token
            if token is None:
                assert s.token_file is not None
                token = Path(s.token_file).read_text().strip()
            self._client.token = token
            data = self._client.auth.token.lookup_self()["data"]
            self._lease_s = float(data.get("ttl") or 0)
            self._renewable = bool(data.get("renewable"))
        elif mode == "approle":
            self._use_auth(self._approle_login())
        elif mode == "kubernetes":
            assert s.kubernetes is not None
            self._use_auth(kubernetes_login(self._client, s.kubernetes))
        else:
            raise ValueError("vault: set token_file, approle or kubernetes")
        self._token_at = self.clock()
        self.logins += 1

    def _approle_login(self) -> dict[str, Any]:
        s = self.settings
        assert s.approle is not None
        role_id = Path(s.approle.role_id_file).read_text().strip()
        if self._secret_id is None:
            raw = Path(s.approle.secret_id_file).read_text().strip()
            if s.approle.secret_id_wrapped:
                # a wrapping token is single-use: unwrap once, keep the secret id
                unwrapper = hvac.Client(
                    url=s.address, token=raw, timeout=s.timeout_s, verify=self._verify
                )
                try:
                    raw = str(unwrapper.sys.unwrap()["data"]["secret_id"])
                finally:
                    unwrapper.adapter.close()
            self._secret_id = raw
        resp = self._client.auth.approle.login(
            role_id=role_id, secret_id=self._secret_id, mount_point=s.approle.mount
        )
        auth: dict[str, Any] = resp["auth"]
        return auth

    def _use_auth(self, auth: dict[str, Any]) -> None:
        """Take the token of a login's `auth` block, with its lease."""
        self._client.token = auth["client_token"]
        self._lease_s = float(auth.get("lease_duration") or 0)
        self._renewable = bool(auth.get("renewable"))

    @property
    def _can_relogin(self) -> bool:
        """A login method that yields a fresh token by itself (a static token does not)."""
        return self._explicit_token is None and self.settings.auth_mode in ("approle",
                                                                            "kubernetes")

    def _renew_sync(self) -> None:
        """Renew the token when 2/3 of its lease is gone; log in again when that fails."""
        if self._lease_s <= 0:
            return
        age = self.clock() - self._token_at
        if age < self._lease_s * 2 / 3:
            return
        if self._renewable:
            try:
                auth = self._client.auth.token.renew_self()["auth"]
                new_lease = float(auth.get("lease_duration") or 0)
                # at max_ttl the lease stops growing: log in again instead of expiring
                if new_lease >= self._lease_s * 0.5 or not self._can_relogin:
                    self._lease_s = new_lease
                    self._token_at = self.clock()
                    self.renewals += 1
                    return
            except Exception as e:  # renewal refused or Vault down: try a fresh login
                log.warning("vault token renewal failed: %s", type(e).__name__)
        if self._can_relogin:
            self._login_sync()

    async def start(self) -> None:
        """Log in (fails when Vault is down: the caller decides whether to retry)."""
        self._start_renewal()
        await self._run(self._login_sync)

    def _start_renewal(self) -> None:
        # also when the first login failed: a later lazy login gets renewed too
        if self._renew_task is None:
            self._renew_task = asyncio.create_task(self._renew_loop())

    async def ensure_login(self) -> bool:
        """Log in if never done; False when Vault is unreachable (calls will 503)."""
        if self.logins:
            return True
        try:
            await self.start()
        except Exception as e:
            # our own errors name the file at fault; hvac's carry URLs and bodies: class only
            why = str(e) if isinstance(e, KubernetesLoginError) else type(e).__name__
            log.warning("vault login failed: %s", why)
            self._set_up(False, type(e).__name__)
            return False
        return True

    async def renew_now(self) -> None:
        await self._run(self._renew_sync)

    async def _renew_loop(self) -> None:
        while True:
            interval = 5.0 if self._lease_s <= 0 else max(0.5, min(30.0, self._lease_s / 6))
            await asyncio.sleep(interval)
            try:
                await self._run(self._renew_sync)
            except Exception as e:
                log.warning("vault renewal/login failed: %s", type(e).__name__)

    async def close(self) -> None:
        if self._renew_task is not None:
            self._renew_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renew_task
            self._renew_task = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.adapter.close()

    # -- reads ---------------------------------------------------------------------------
    def _read_sync(self, key: CacheKey) -> SecretValue:
        mount, path, field = key
        for attempt in range(2):
            try:
                if not self.logins:
                    self._login_sync()
                self.reads += 1
                resp = self._client.secrets.kv.v2.read_secret_version(
                    path=path, mount_point=mount, raise_on_deleted_version=True
                )
                break
            except hvac.exceptions.Forbidden:
                # token expired or revoked: log in again once, then give up
                if attempt == 0 and (self._can_relogin or self.settings.token_file):
                    self._login_sync()
                    continue
                raise
            except hvac.exceptions.InvalidPath:
                raise _Missing("secret not found") from None
        data = resp["data"]
        value = (data.get("data") or {}).get(field)
        if not isinstance(value, str) or not value:
            raise _Missing("field missing")
        return SecretValue(value, int(data["metadata"]["version"]), self.clock())

    async def _fetch(self, key: CacheKey) -> SecretValue:
        t0 = time.perf_counter()
        ok = False
        try:
            sv = await self._run(self._read_sync, key)
            ok = True
            return sv
        finally:
            if self.on_read is not None:
                self.on_read(time.perf_counter() - t0, ok)

    def _set_up(self, up: bool, cause: str = "") -> None:
        if up != self._up:
            self._up = up
            if self.on_status is not None:
                self.on_status("up" if up else "down", cause)

    def _count(self, what: str) -> None:
        if self.on_cache is not None:
            self.on_cache(what)

    def fresh(self, cred: CredentialSource) -> SecretValue | None:
        """The cached secret while within its TTL (counted as a hit), else None: the
        per-call case without creating and awaiting a coroutine; `get` does the rest."""
        entry = self._cache.get((cred.mount, cred.path, cred.field))
        if entry is not None and self.clock() - entry.fetched_at < self.cache_ttl_s:
            self._count("hit")
            return entry
        return None

    async def get(self, cred: CredentialSource) -> SecretValue:
        key: CacheKey = (cred.mount, cred.path, cred.field)
        entry = self._cache.get(key)
        now = self.clock()
        if entry is not None and now - entry.fetched_at < self.cache_ttl_s:
            self._count("hit")
            return entry
        fut = self._inflight.get(key)
        leader = fut is None
        if fut is not None:
            self._count("coalesced")  # joined a read already in flight (single-flight)
        else:
            fut = asyncio.ensure_future(self._fetch(key))
            self._inflight[key] = fut
            fut.add_done_callback(lambda _f, k=key: self._inflight.pop(k, None))
        try:
            # shield: one caller going away must not cancel the read the others wait on
            sv = await asyncio.shield(fut)
        except _Missing:
            self._cache.pop(key, None)  # a deleted secret is revoked: never serve it stale
            raise VaultUnavailable("missing") from None
        except Exception as e:
            cause = type(e).__name__
            self._set_up(False, cause)
            if entry is not None and now - entry.fetched_at < self.cache_ttl_s + self.serve_stale_s:
                self._count("stale")
                return entry
            raise VaultUnavailable(cause) from None
        self._set_up(True)
        if leader:
            self._count("miss")
        self._cache[key] = sv
        return sv

    def status(self) -> dict[str, Any]:
        return {
            "vault_up": self._up,
            "vault_reads": self.reads,
            "vault_logins": self.logins,
            "vault_renewals": self.renewals,
            "cached_secrets": len(self._cache),
        }
