"""Reading `stockade.yaml` into a mapping: the strict YAML load (duplicate keys refused)
and its error lines (`file: what`). Without pydantic: `configfile` validates the mapping
with the models, `configpeek` (the short `sandbox` commands) checks the few keys it
uses by hand, and both read the file through this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of silently keeping the last."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            m = key_node.start_mark
            raise ConfigError(f"{m.line + 1}:{m.column + 1}: duplicate key {key!r}")
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_mapping(p: Path) -> dict[Any, Any]:
    """The file's top-level mapping (an empty file: {}); ConfigError when it cannot be
    read, is no valid YAML, repeats a key or is no mapping."""
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{p}:{e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    return data
