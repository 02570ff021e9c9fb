"""What the broker reads of stockade.yaml, as a structural type.

`stockade.config.Config` fits it; the broker never imports the top floor. The gateway's
and the DNS firewall's sections are read only for their upstream resolvers
(`upstream_dns.checked_resolver`): typed `Any` so the broker does not depend on the
gateway's models either.
"""

from __future__ import annotations

from typing import Any, Protocol

from stockade.events import EventWriter

from .settings import BrokerSettings, DevVaultSettings, VaultSettings


class BrokerConfig(Protocol):
    # read-only properties: the composed model is frozen
    @property
    def rules_dir(self) -> str: ...
    @property
    def state_dir(self) -> str: ...
    @property
    def broker(self) -> BrokerSettings: ...
    @property
    def vault(self) -> VaultSettings: ...
    @property
    def dev_vault(self) -> DevVaultSettings: ...  # enabled: false -> no Vault at all
    @property
    def gateway(self) -> Any: ...  # resolvers, allow_addresses
    @property
    def dns(self) -> Any: ...  # ttl_min_s, ttl_max_s

    def event_writer(self, *, stdout: bool | None = None) -> EventWriter: ...
