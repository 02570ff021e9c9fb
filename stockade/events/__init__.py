"""The shared event schema and its writer (see build.py, schema.json, writer.py).

The writer's and builder's names are imported on first use (stockade/lazy.py): a reader
of one submodule (`stockade.events.view` for `stockade events`) does not load the
writer's signing chain."""

import json
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from stockade.lazy import exports_of, lazy_exports

if TYPE_CHECKING:
    from .build import ECS_VERSION, SCHEMA_VERSION, make_event, timestamp
    from .writer import Event, EventWriter, read_events

__getattr__ = lazy_exports(__name__, exports_of({
    ".build": ("ECS_VERSION", "SCHEMA_VERSION", "make_event", "timestamp"),
    ".writer": ("Event", "EventWriter", "read_events"),
}))


@cache
def schema() -> dict[str, Any]:
    return json.loads(resources.files(__package__).joinpath("schema.json").read_text())


def validate(event: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when `event` does not match the schema."""
    import jsonschema

    jsonschema.validate(event, schema())


__all__ = [
    "ECS_VERSION",
    "SCHEMA_VERSION",
    "Event",
    "EventWriter",
    "make_event",
    "read_events",
    "schema",
    "timestamp",
    "validate",
]
