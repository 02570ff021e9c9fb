"""The writer, throttle, chain signer and encoder that an `events:` section asks for,
from any object with that section's fields: `EventSettings` (the pydantic model) and
`stockade.configpeek`'s hand-checked section (the short `sandbox` commands, which do
not import pydantic) make them the same way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .probemark import NO_WINDOW, ProbeWindow

# the chain (cryptography), the writer, the throttle and the OCSF encoder are imported
# where they are made: every command loads the configuration, and `stockade sandbox list`
# or `rules explain` never writes an event
if TYPE_CHECKING:
    from .chain import ChainSigner
    from .summary import ThrottleSettings
    from .writer import EventWriter


def throttle_of(s: Any, probes: ProbeWindow = NO_WINDOW) -> ThrottleSettings:
    from .summary import ThrottleSettings

    return ThrottleSettings(
        verbatim_per_key=s.verbatim_per_key, window_s=s.summary_window_s,
        task_events=s.task_budget_events, task_bytes=s.task_budget_bytes,
        keys_per_task=s.keys_per_task, probes=probes)


def signer_of(s: Any) -> ChainSigner:
    from .chain import ChainSigner
    from .chainkey import load_or_create_key

    key = load_or_create_key(s.chain_dir) if s.chain and s.chain_dir else None
    return ChainSigner(key, s.chain_dir if key is not None else None, link=s.chain,
                       every=s.checkpoint_every, interval_s=s.checkpoint_s)


def encoder_of(s: Any) -> Callable[[dict[str, Any]], bytes] | None:
    if s.format != "ocsf":
        return None  # the writer's own (ECS)
    from .ocsf import encode_ocsf

    return encode_ocsf


def writer_of(s: Any, path: str | Path | None, task_dir: str | Path | None,
              stdout: bool, probes: ProbeWindow = NO_WINDOW) -> EventWriter:
    from .writer import EventWriter

    return EventWriter(
        path, max_bytes=s.max_bytes, backups=s.backups, stdout=stdout,
        throttle=throttle_of(s, probes), task_dir=task_dir,
        task_store_bytes=s.task_store_bytes, chain=signer_of(s), encode=encoder_of(s))
