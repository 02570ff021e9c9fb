"""The `events:` section of stockade.yaml: the events file, its rotation, the per-task
throttle and the chain. On the ground floor so every component (and the inspector child,
which gets the section as JSON) reads it without the top floor's `stockade.config`, which
composes it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .fromsettings import encoder_of, signer_of, throttle_of, writer_of
from .probemark import NO_WINDOW, ProbeWindow

if TYPE_CHECKING:
    from .chain import ChainSigner
    from .summary import ThrottleSettings
    from .writer import EventWriter


class EventSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # line format: ECS (schema.json) or OCSF 1.5.0 (ocsf.py; docs/events.md "OCSF")
    format: Literal["ecs", "ocsf"] = "ecs"
    file: str | None = None  # JSON-lines events file; default: <log_dir>/events.jsonl
    stdout: bool = False  # also write every event to standard output
    max_bytes: int = Field(50 * 2**20, gt=0)  # rotate the events file at this size
    backups: int = Field(5, ge=0)  # rotated files kept (events.jsonl.1 ...)
    # denied events of one task with the same (component, action, reason, destination)
    # written one by one; later ones are counted in `event_summary` events
    verbatim_per_key: int = Field(20, ge=0)
    summary_window_s: float = Field(60.0, gt=0)  # seconds a summary event counts for
    # events written one by one per task (per component process); past this or the byte
    # budget, every further event of the task, allowed or denied, is only counted
    task_budget_events: int = Field(2000, ge=0)
    task_budget_bytes: int = Field(2 * 2**20, ge=0)  # bytes written one by one per task
    # distinct summary keys per task; further keys share one overflow key
    keys_per_task: int = Field(64, ge=1)
    # per-task event store (one file per task, never rotated); default: <log_dir>/tasks
    task_dir: str | None = None
    task_store_bytes: int = Field(4 * 2**20, gt=0)  # task store cap per task and process
    task_retention_s: float = Field(86400.0, ge=0)  # task store files older than this are removed
    # hash-chain each process's lines (event.sequence, stockade.chain.prev) and sign
    # checkpoints (docs/events-integrity.md); false: only event.id and event.sequence
    chain: bool = True
    # signing key (signing.key, signing.pub) and heads/; default (or null):
    # <state_dir>/events-chain
    chain_dir: str | None = None
    checkpoint_every: int = Field(1000, ge=1)  # a signed checkpoint after this many lines
    checkpoint_s: float = Field(60.0, gt=0)  # or after this many seconds, whichever is first

    def throttle(self, probes: ProbeWindow = NO_WINDOW) -> ThrottleSettings:
        """`probes`: where and when the fence self-test's unmarked probes come (probemark.py)."""
        return throttle_of(self, probes)

    def chain_signer(self) -> ChainSigner:
        """A new stream's signer (one per writer). Without chain_dir it links lines but
        signs nothing; raises chainkey.ChainError when the key cannot be read or made."""
        return signer_of(self)

    def encoder(self) -> Callable[[dict[str, Any]], bytes] | None:
        """The writer's line encoder for `format`; None: the writer's own (ECS)."""
        return encoder_of(self)

    def writer(self, path: str | Path | None, task_dir: str | Path | None,
               stdout: bool, probes: ProbeWindow = NO_WINDOW) -> EventWriter:
        """An event writer with these settings: throttle, per-task store and chain included
        (its own stream). Raises chainkey.ChainError when the signing key is unusable."""
        return writer_of(self, path, task_dir, stdout, probes)
