"""Walk the file models of schema.py along a document's keys: which keys a mapping at a
path may have (lint's 'did you mean'), in which order (`rules fmt`), and which model
each file kind is."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel

from .schema import ApiModel, CatalogueModel, PresetModel, ProfileModel, TestFileModel

# a rules directory's folders (sources.KINDS) and the model of their files
KIND_MODELS: dict[str, type[BaseModel]] = {
    "profiles": ProfileModel,
    "presets": PresetModel,
    "apis": ApiModel,
    "tests": TestFileModel,
    "catalogues": CatalogueModel,
}


def _models_in(tp: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (`list[X] | None`, `dict[str, X]`, ...)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for arg in get_args(tp) for m in _models_in(arg)]


def keys_at(model: type[BaseModel], path: tuple[str | int, ...]) -> list[str]:
    """The keys the mapping at `path` of a `model` document may have ([] when unknown).
    List indexes are stepped over; a part that is not a field is taken for the key of a
    name-keyed mapping (`broker.apis.<name>`), whose values are the same model."""
    cur: type[BaseModel] | None = model
    for part in path:
        if cur is None:
            return []
        if isinstance(part, str):
            cur = nested_model(cur, part)
    return list(cur.model_fields) if cur is not None else []


def nested_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The model of the value at `key` of a `model` mapping (of its items when it is a
    list or a name-keyed mapping); `model` itself when `key` is not one of its fields
    (the key of a name-keyed mapping); None for a plain value."""
    if key not in model.model_fields:
        return model
    found = _models_in(model.model_fields[key].annotation)
    return found[0] if found else None
