"""What the broker's credential path shares with or without a Vault: the secret value, the
refusal `VaultUnavailable`, and `NoVault`, the source of a broker that has none. Apart
from broker/vault.py so a broker without a Vault never imports hvac (and requests under
it: a good part of an embedded stack's start)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class VaultUnavailable(Exception):
    """No usable credential: Vault unreachable/failing past serve-stale, or secret missing.

    `str()` is a fixed phrase; the underlying cause is only its class name in `cause`.
    """

    code = "vault_unavailable"

    def __init__(self, cause: str = "") -> None:
        super().__init__("credential store unavailable")
        self.cause = cause


@dataclass(frozen=True, slots=True)
class SecretValue:
    value: str
    version: int
    fetched_at: float  # monotonic

    def __repr__(self) -> str:  # a stray log line must not print the value
        return f"SecretValue(version={self.version}, value=<redacted>)"


class NoVault:
    """The credential source of a broker that has no Vault (`dev_vault.enabled: false`
    without `vault.address`): nothing to log in to, every read refused. Fail closed: a
    grant added to the rules later is refused `vault_unavailable`, never served."""

    async def ensure_login(self) -> bool:
        return False

    async def get(self, cred: Any) -> SecretValue:
        raise VaultUnavailable("no_vault")

    def status(self) -> dict[str, Any]:
        return {"vault_up": False, "vault": "none"}

    async def close(self) -> None:
        return None
