"""deploy/elasticsearch and deploy/opensearch: the index template, its mappings and the
ingest pipeline are what stockade.events.esmap makes of the current schema.json, they map
every schema field with its type, and the pipeline touches only fields the schema has or
the mappings declare."""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import pytest
from deploy_support import DEPLOY, REPO

from stockade.events import esmap, schema

REGEN = "python -m stockade.events.esmap --flavor {f} --out deploy/{f}"


def _checked_in(flavor: str, key: str) -> dict[str, Any]:
    return json.loads((DEPLOY / flavor / esmap.FILES[key]).read_text())


def _mapped(props: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A mapping's `properties` -> {dotted name: type}: the inverse of the nesting."""
    out: dict[str, str] = {}
    for key, node in props.items():
        if "properties" in node:
            out |= _mapped(node["properties"], f"{prefix}{key}.")
        else:
            out[prefix + key] = node["type"]
    return out


def _mapping_fields(flavor: str) -> dict[str, str]:
    return _mapped(_checked_in(flavor, "mappings")["template"]["mappings"]["properties"])


@pytest.mark.parametrize("flavor", esmap.FLAVORS)
def test_checked_in_files_are_generated_from_the_schema(flavor: str) -> None:
    for name, text in esmap.render(schema(), flavor).items():
        path = DEPLOY / flavor / name
        assert path.read_text() == text, f"{path} is stale: run {REGEN.format(f=flavor)}"


@pytest.mark.parametrize("flavor", esmap.FLAVORS)
def test_every_schema_field_is_mapped_with_its_type(flavor: esmap.Flavor) -> None:
    mapped = _mapping_fields(flavor)
    want = dict(esmap.leaves(schema())) | esmap.PIPELINE_FIELDS
    assert set(mapped) == set(want)
    for name, es in want.items():
        assert mapped[name] == esmap.flavored(es, flavor), name
    assert _checked_in(flavor, "mappings")["template"]["mappings"]["dynamic"] is False


def test_opensearch_gets_only_types_it_has() -> None:
    types = set(_mapping_fields("opensearch").values())
    assert not types & set(esmap.OPENSEARCH_TYPE), types


def test_ecs_fields_get_the_type_ecs_defines() -> None:
    """Against Elastic's field definitions of the ECS version the schema names (vendored
    as test data with schema 2.0); schema 1.0 names none."""
    version = _checked_in("elasticsearch", "mappings")["_meta"].get("ecs_version")
    if version is None:
        pytest.skip(f"{schema()['$id']} names no ECS version")
    flat = REPO / "tests" / "data" / f"ecs-{version}-flat.json"
    fields = json.loads(flat.read_text())["fields"]
    for name, es in _mapping_fields("elasticsearch").items():
        if not name.startswith("stockade."):
            assert name in fields, f"{name} is no ECS field"
            assert es == fields[name][0], f"{name}: {es}, ECS says {fields[name][0]}"


def test_leaves_use_x_es_type_and_stop_at_typed_objects() -> None:
    """The shape of schema 2.0: every leaf typed, an open object typed as one leaf."""
    s = copy.deepcopy(schema())
    s["properties"]["url"]["properties"]["path"]["x-es-type"] = "wildcard"
    s["properties"]["source"]["properties"]["port"]["x-es-type"] = "integer"
    s["properties"]["stockade"]["properties"]["totals"] = {
        "type": "object", "x-es-type": "flattened", "properties": {"written": {"type": "integer"}}
    }
    got = dict(esmap.leaves(s))
    assert got["url.path"] == "wildcard" and got["source.port"] == "integer"
    assert got["stockade.totals"] == "flattened" and "stockade.totals.written" not in got
    s["properties"]["stockade"]["properties"]["odd"] = {"anyOf": [{"type": "string"}]}
    with pytest.raises(ValueError, match=r"stockade\.odd: no x-es-type"):
        dict(esmap.leaves(s))


def test_the_pipeline_sets_the_id_only_from_a_declared_event_id() -> None:
    s = copy.deepcopy(schema())
    s["properties"]["event"]["properties"]["id"] = {"type": "string", "x-es-type": "keyword"}
    ids = [p["set"] for p in esmap.ingest_pipeline(s)["processors"] if p["set"]["field"] == "_id"]
    assert ids == [{"if": "ctx.event?.id != null", "field": "_id", "value": "{{{event.id}}}"}]
    without = copy.deepcopy(schema())
    without["properties"]["event"]["properties"].pop("id", None)
    assert all(p["set"]["field"] != "_id" for p in esmap.ingest_pipeline(without)["processors"])


@pytest.mark.parametrize("flavor", esmap.FLAVORS)
def test_the_pipeline_names_only_schema_and_mapped_fields(flavor: str) -> None:
    pipe = _checked_in(flavor, "pipeline")
    steps = [p["set"] for p in pipe["processors"] + pipe["on_failure"]]
    read = {m for s in steps for m in re.findall(r"\{\{\{([^}]+)\}\}\}", s["value"])}
    conditions = " ".join(s.get("if", "") for s in steps)
    read |= {m.replace("?", "") for m in re.findall(r"ctx\.([\w.?]+)", conditions)}
    read = {f for f in read if not f.startswith("_ingest.")}
    assert read <= dict(esmap.leaves(schema())).keys(), read
    written = {s["field"] for s in steps} - {"_id"}
    assert written <= _mapping_fields(flavor).keys(), written
    kind = next(s["value"] for s in steps if s["field"] == "event.kind")
    assert kind == "pipeline_error"  # an ECS event.kind value, kept out of the schema's own


@pytest.mark.parametrize("flavor", esmap.FLAVORS)
def test_the_index_template_composes_the_mappings_and_the_pipeline(flavor: str) -> None:
    t = _checked_in(flavor, "template")
    assert t["composed_of"] == [esmap.COMPONENT_TEMPLATE] and t["data_stream"] == {}
    assert t["template"]["settings"]["index.default_pipeline"] == esmap.PIPELINE
    assert t["_meta"]["schema"] == schema()["$id"]
    components = schema()["properties"]["stockade"]["properties"]["component"]["enum"]
    for c in components:  # the data stream of each component's event.dataset
        assert any(fnmatch.fnmatch(f"logs-stockade.{c}-default", p) for p in t["index_patterns"])


def test_the_command_writes_the_files_and_refuses_a_bad_out(tmp_path: Path, capsys) -> None:
    assert esmap.main(["--flavor", "opensearch", "--out", str(tmp_path / "os")]) == 0
    for name in esmap.FILES.values():
        assert (tmp_path / "os" / name).read_text() == (DEPLOY / "opensearch" / name).read_text()
    (tmp_path / "file").write_text("")
    assert esmap.main(["--flavor", "elasticsearch", "--out", str(tmp_path / "file")]) == 2
    assert "esmap:" in capsys.readouterr().err
