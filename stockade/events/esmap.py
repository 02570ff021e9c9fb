"""Elasticsearch / OpenSearch index template and ingest pipeline, generated from
schema.json so the index maps exactly the fields the components write.

`python -m stockade.events.esmap --flavor elasticsearch --out deploy/elasticsearch` (and
`--flavor opensearch --out deploy/opensearch`) writes the three files checked in there;
tests/deploy/test_deploy_esmap.py fails when they differ from what this module makes of
the current schema.json, so a schema change is followed by re-running it.

Each schema leaf is mapped with its `x-es-type` (the ECS type). A schema without one on
a leaf (event schema 1.0) is mapped from its JSON type, and ECS's few typed fields of
that schema by name: that fallback is what keeps the older schema mappable.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

Flavor = Literal["elasticsearch", "opensearch"]
FLAVORS: tuple[Flavor, ...] = ("elasticsearch", "opensearch")

COMPONENT_TEMPLATE = "stockade-events-mappings"
PIPELINE = "stockade-events"
# Elastic's data stream naming: logs-<dataset>-<namespace>; the dataset is event.dataset
INDEX_PATTERNS = ["logs-stockade.*-*"]
# above the built-in logs-*-* template (priority 100), which would otherwise match too
PRIORITY = 200
FILES = {
    "mappings": "stockade-events-mappings.json",
    "template": "stockade-events-template.json",
    "pipeline": "stockade-events-pipeline.json",
}

# OpenSearch lacks these Elasticsearch types; the nearest one it has
OPENSEARCH_TYPE = {
    "wildcard": "keyword",
    "match_only_text": "text",
    "constant_keyword": "keyword",
    "flattened": "flat_object",
}
# fallback for leaves without x-es-type
_JSON_TYPE = {"string": "keyword", "integer": "long", "number": "double", "boolean": "boolean"}
_ECS_BY_NAME = {
    "@timestamp": "date",
    "message": "match_only_text",
    "source.ip": "ip",
    "destination.ip": "ip",
    "url.full": "wildcard",
    "url.path": "wildcard",
}
# the fields the pipeline adds (ECS fields, not written by Stockade), mapped like the rest
PIPELINE_FIELDS = {"event.ingested": "date", "error.message": "match_only_text"}


def leaves(schema: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(dotted field name, ES type) for every leaf of the event schema."""
    yield from _walk(schema["properties"], "")


def _walk(props: dict[str, Any], prefix: str) -> Iterator[tuple[str, str]]:
    for key, node in props.items():
        name = prefix + key
        if "x-es-type" not in node and "properties" in node:
            yield from _walk(node["properties"], name + ".")
        else:
            yield name, es_type(name, node)


def es_type(name: str, node: dict[str, Any]) -> str:
    """The leaf's x-es-type, else the fallback (see the module docstring)."""
    if "x-es-type" in node:
        return str(node["x-es-type"])
    if name in _ECS_BY_NAME:
        return _ECS_BY_NAME[name]
    item = node.get("items", node) if node.get("type") == "array" else node
    if item.get("type") == "object":
        return "flattened"  # an open map or a list of records: searchable, no mapping growth
    if "enum" in item or "const" in item:
        return "keyword"
    try:
        return _JSON_TYPE[item["type"]]
    except KeyError:
        raise ValueError(f"schema field {name}: no x-es-type and no JSON type to map") from None


def flavored(es: str, flavor: Flavor) -> str:
    return OPENSEARCH_TYPE.get(es, es) if flavor == "opensearch" else es


def _nest(fields: dict[str, str], flavor: Flavor) -> dict[str, Any]:
    """Dotted names -> nested `properties` objects, as a mapping declares them."""
    root: dict[str, Any] = {}
    for name, es in fields.items():
        *parents, last = name.split(".")
        node = root
        for part in parents:
            node = node.setdefault(part, {"properties": {}})["properties"]
        node[last] = {"type": flavored(es, flavor)}
    return root


def _meta(schema: dict[str, Any]) -> dict[str, str]:
    meta = {"schema": str(schema["$id"]), "generated_by": "python -m stockade.events.esmap"}
    ecs = schema["properties"].get("ecs", {}).get("properties", {}).get("version", {})
    if "const" in ecs:
        meta["ecs_version"] = str(ecs["const"])
    return meta


def component_template(schema: dict[str, Any], flavor: Flavor) -> dict[str, Any]:
    """The mappings, as a component template. dynamic: false keeps an unknown field in
    _source without indexing it, so a newer writer never breaks or bloats the index."""
    fields = dict(leaves(schema))
    for name, es in PIPELINE_FIELDS.items():
        fields.setdefault(name, es)
    return {
        "template": {"mappings": {"dynamic": False, "properties": _nest(fields, flavor)}},
        "_meta": _meta(schema),
    }


def index_template(schema: dict[str, Any]) -> dict[str, Any]:
    """The composable index template of the data streams (the same for both flavors)."""
    return {
        "index_patterns": INDEX_PATTERNS,
        "data_stream": {},
        "priority": PRIORITY,
        "composed_of": [COMPONENT_TEMPLATE],
        "template": {"settings": {"index.default_pipeline": PIPELINE}},
        "_meta": _meta(schema),
    }


def ingest_pipeline(schema: dict[str, Any]) -> dict[str, Any]:
    """event.ingested; _id = event.id when the schema has it, so a shipper's retry of a
    line is refused as a duplicate (409) instead of stored twice (within one backing
    index: a rollover between the two tries still stores both); on failure, the event is
    kept and marked."""
    processors: list[dict[str, Any]] = [
        {"set": {"field": "event.ingested", "value": "{{{_ingest.timestamp}}}"}},
    ]
    what = "event.ingested"
    if "event.id" in dict(leaves(schema)):
        processors.append(
            {"set": {"if": "ctx.event?.id != null", "field": "_id", "value": "{{{event.id}}}"}}
        )
        what += ", _id from event.id"
    return {
        "description": f"Stockade events ({schema['$id']}): sets {what}",
        "processors": processors,
        "on_failure": [
            {"set": {"field": "event.kind", "value": "pipeline_error"}},
            {"set": {"field": "error.message", "value": "{{{_ingest.on_failure_message}}}"}},
        ],
    }


def render(schema: dict[str, Any], flavor: Flavor) -> dict[str, str]:
    """File name -> text, as checked in under deploy/<flavor>/."""
    docs = {
        "mappings": component_template(schema, flavor),
        "template": index_template(schema),
        "pipeline": ingest_pipeline(schema),
    }
    return {FILES[k]: json.dumps(v, indent=2) + "\n" for k, v in docs.items()}


def main(argv: list[str] | None = None) -> int:
    from . import schema

    p = argparse.ArgumentParser(prog="python -m stockade.events.esmap", description=__doc__)
    p.add_argument("--flavor", choices=FLAVORS, required=True)
    p.add_argument("--out", type=Path, required=True, help="directory to write the files to")
    args = p.parse_args(argv)
    try:
        files = render(schema(), args.flavor)
        args.out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (args.out / name).write_text(text)
    except (OSError, ValueError) as e:
        print(f"esmap: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
