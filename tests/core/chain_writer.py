"""A component's writer with its settings' chain, for the chain tests."""

from __future__ import annotations

from pathlib import Path

from stockade.events import EventWriter
from stockade.events.settings import EventSettings


def chained_writer(settings: EventSettings, path: Path, task_dir: Path | None,
                   stdout: bool) -> EventWriter:
    """`settings.writer(...)` with `settings.chain_signer()` attached. The components'
    writers get their chain once schema.json declares event.id, event.sequence and
    stockade.chain (every suite validates the events it sees against it)."""
    w = settings.writer(path, task_dir, stdout)
    w.chain = settings.chain_signer()
    return w
