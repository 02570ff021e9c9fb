"""ECS conformance of one Stockade event against Elastic's own field definitions
(tests/data/ecs-9.4.0-flat.json, reduced from npm @elastic/ecs@9.4.0 by make_ecs_flat.js).

Pure; `problems(ev, ecs)` returns what is wrong, empty when nothing is. The rules: the
required fields are present; every leaf outside `stockade.*` (the custom namespace, which
schema.json closes) is an ECS field whose value has its ECS type; `labels.*` are strings;
event.kind/category/type/outcome take allowed values; and, read strictly, every
`event.type` is among the expected types of EVERY `event.category` of the event.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data" / "ecs-9.4.0-flat.json"
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
_STRINGS = {"keyword", "wildcard", "constant_keyword", "match_only_text", "text"}
_FLOATS = {"float", "scaled_float", "double", "half_float"}
_OBJECTS = {"object", "flattened", "nested"}
CUSTOM = "stockade"  # the one namespace ECS does not define


@cache
def load(path: Path = DATA) -> dict[str, Any]:
    return json.loads(path.read_text())


def leaves(d: dict[str, Any], pre: str = "") -> Iterator[tuple[str, Any]]:
    """(flat name, value) of every leaf; `labels` is one level of values."""
    for k, v in d.items():
        name = f"{pre}{k}"
        if isinstance(v, dict) and name != "labels":
            yield from leaves(v, f"{name}.")
        elif isinstance(v, dict):
            yield from ((f"labels.{lk}", lv) for lk, lv in v.items())
        else:
            yield name, v


def type_ok(es_type: str, v: Any) -> bool:
    """Whether the JSON value `v` is a value of the Elasticsearch type `es_type`."""
    if es_type in _STRINGS:
        return isinstance(v, str)
    if es_type == "long":
        return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
    if es_type in _FLOATS:
        return isinstance(v, int | float) and not isinstance(v, bool)
    if es_type == "boolean":
        return isinstance(v, bool)
    if es_type == "date":
        return isinstance(v, str) and bool(_DATE.match(v))
    if es_type == "ip":
        try:
            ipaddress.ip_address(v)
        except (ValueError, TypeError):
            return False
        return True
    return es_type in _OBJECTS and isinstance(v, dict | list)


def _missing(ev: dict[str, Any], required: list[str]) -> list[str]:
    out = []
    for req in required:
        node: Any = ev
        for part in [req] if req.startswith("@") else req.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            out.append(f"missing required {req}")
    return out


def _field_problems(path: str, v: Any, ecs: dict[str, Any]) -> list[str]:
    spec = ecs["fields"].get(path)
    if spec is None:
        return [f"{path}: not an ECS {ecs['ecs_version']} field"]
    out = []
    if isinstance(v, list) and "array" not in spec:
        out.append(f"{path}: ECS field is not an array")
    if "array" in spec and not isinstance(v, list):
        out.append(f"{path}: ECS expects an array")
    values = v if isinstance(v, list) else [v]
    return out + [f"{path}: {x!r} is not ECS type {spec[0]}" for x in values
                  if not type_ok(spec[0], x)]


def _value_problems(e: dict[str, Any], allowed: dict[str, Any]) -> list[str]:
    out = [f"event.{k} {e[k]!r} not allowed" for k in ("kind", "outcome")
           if k in e and e[k] not in allowed[f"event.{k}"]]
    types = e.get("type", [])
    for c in e.get("category", []):
        expected = allowed["event.category"].get(c)
        if expected is None:
            out.append(f"event.category {c!r} not allowed")
            continue
        out += [f"event.type {t!r} not expected for event.category {c!r}" for t in types
                if t not in expected]
    return out + [f"event.type {t!r} not allowed" for t in types
                  if t not in allowed["event.type"]]


def problems(ev: dict[str, Any], ecs: dict[str, Any] | None = None) -> list[str]:
    """Every way `ev` breaks ECS (`ecs`: the vendored definitions, `load()` by default)."""
    ecs = load() if ecs is None else ecs
    out = _missing(ev, ecs["required"])
    for path, v in leaves(ev):
        top = path.split(".", 1)[0]
        if top == CUSTOM:
            continue
        if top == "labels":
            if not isinstance(v, str):
                out.append(f"{path}: labels.* must be strings")
            continue
        out += _field_problems(path, v, ecs)
    e = ev.get("event")
    return out + (_value_problems(e, ecs["allowed"]) if isinstance(e, dict) else [])


def schema_leaves(node: dict[str, Any], pre: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(flat name, JSON-schema node) of every leaf that schema.json declares; an object
    with fixed `properties` is walked, anything else (labels' values too) is a leaf."""
    for k, sub in node.get("properties", {}).items():
        name = f"{pre}{k}"
        if "properties" in sub and name != "labels":
            yield from schema_leaves(sub, f"{name}.")
        else:
            yield name, sub
