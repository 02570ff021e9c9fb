"""What the gateway reads of stockade.yaml, as a structural type.

`stockade.config.Config` (the top floor's composed model) fits it; the gateway never
imports it, so the dependency points down: the top floor builds a Config and hands it
to `GatewayService` / `InspectorSupervisor`, which see only these attributes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from stockade.events import EventWriter
from stockade.events.settings import EventSettings

from .dns.settings import DnsSettings
from .settings import GatewaySettings


class GatewayConfig(Protocol):
    # read-only properties: the composed model is frozen
    @property
    def rules_dir(self) -> str: ...
    @property
    def state_dir(self) -> str: ...
    @property
    def gateway(self) -> GatewaySettings: ...
    @property
    def dns(self) -> DnsSettings: ...
    @property
    def events(self) -> EventSettings: ...
    @property
    def events_file(self) -> Path: ...
    @property
    def task_events_dir(self) -> Path: ...

    def event_writer(self, *, stdout: bool | None = None) -> EventWriter: ...
