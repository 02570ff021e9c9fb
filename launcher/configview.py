"""What the launcher reads of stockade.yaml, as a structural type.

`stockade.config.Config` fits it; the launcher never imports the top floor. The other
components' sections are read only for addresses and sockets (listen ports for the nft
table, control sockets, what the scrubber hides): typed `Any` so the launcher does not
depend on their models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from stockade.events import EventWriter
from stockade.events.settings import EventSettings

from .settings import LauncherSettings


class LauncherConfig(Protocol):
    # read-only properties: the composed model is frozen
    @property
    def rules_dir(self) -> str: ...
    @property
    def state_dir(self) -> str: ...
    @property
    def log_dir(self) -> str: ...
    @property
    def run_dir(self) -> str: ...
    @property
    def launcher(self) -> LauncherSettings: ...
    @property
    def events(self) -> EventSettings: ...
    @property
    def task_events_dir(self) -> Path: ...
    @property
    def gateway(self) -> Any: ...  # listeners, resolvers, control socket, inspection
    @property
    def dns(self) -> Any: ...  # listen
    @property
    def broker(self) -> Any: ...  # listen, control socket
    @property
    def vault(self) -> Any: ...  # address

    def event_writer(self, *, stdout: bool | None = None) -> EventWriter: ...
