"""`stockade.yaml`: one file configures every component.

Each component owns the model of its own section (`gateway/settings.py`, ...); this module
composes them, loads the YAML strictly (unknown keys are errors) and supplies defaults
for a single-host install. Every key and default is documented in the README. The loading
itself and the top-level keys are configfile.py's (shared with the launcher's short
commands, which validate only their own sections).
"""

from __future__ import annotations

from pathlib import Path

from stockade.broker.settings import BrokerSettings, DevVaultSettings, VaultSettings
from stockade.configfile import ConfigError, Shared, load_as
from stockade.events.settings import EventSettings
from stockade.gateway.dns.settings import DnsSettings
from stockade.gateway.settings import GatewaySettings
from stockade.launcher.settings import LauncherSettings
from stockade.stack.settings import StackSettings

__all__ = ["Config", "ConfigError", "load_config"]


class Config(Shared):
    events: EventSettings = EventSettings()
    gateway: GatewaySettings = GatewaySettings()
    dns: DnsSettings = DnsSettings()
    broker: BrokerSettings = BrokerSettings()
    vault: VaultSettings = VaultSettings()
    launcher: LauncherSettings = LauncherSettings()
    dev_vault: DevVaultSettings = DevVaultSettings()
    stack: StackSettings = StackSettings()


def load_config(path: str | Path | None) -> Config:
    """Load `stockade.yaml`; None gives the embedded defaults."""
    return load_as(Config, path)
