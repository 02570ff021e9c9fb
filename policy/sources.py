"""The rule files of a rules directory: read, parsed, and each one's problem sink.

`read_sources` never raises on a bad file: it records the problem (file:line) and goes on,
so `stockade rules lint` can list every problem of the set at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .kinds import KINDS
from .model import SourceLocation
from .problems import Problem
from .schemawalk import keys_at
from .suggest import did_you_mean
from .yamlsrc import Document, Path_, YamlProblem, dotted, read_yaml

M = TypeVar("M", bound=BaseModel)


class Source:
    """One rule file: its name for messages, parsed document, and the problem sink."""

    def __init__(self, path: Path, doc: Document, problems: list[Problem]) -> None:
        self.name = str(path)
        self.doc = doc
        self.problems = problems

    def loc(self, path: Path_) -> SourceLocation:
        m = self.doc.mark_for(path)
        return SourceLocation(self.name, m.line, m.column)

    def error(self, path: Path_, message: str, at_key: bool = False) -> None:
        m = self.doc.key_marks.get(path) if at_key else None
        m = m or self.doc.mark_for(path)
        self.problems.append(Problem(self.name, m.line, m.column, f"{dotted(path)}: {message}"))

    def validate(self, model: type[M]) -> M | None:
        if not isinstance(self.doc.data, dict):
            self.error((), "expected a mapping at the top level")
            return None
        try:
            return model.model_validate(self.doc.data)
        except ValidationError as e:
            for err in e.errors():
                path = tuple(p for p in err["loc"] if isinstance(p, int) or "[" not in p)
                self.error(path, _message(err, model, path),
                           at_key=err["type"] == "extra_forbidden")  # fmt: skip
            return None


def _message(err: Any, model: type[BaseModel], path: Path_) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        key = str(path[-1]) if path else ""
        return "unknown key" + did_you_mean(key, keys_at(model, path[:-1]))
    if kind == "missing":
        return "required key is missing"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def read_sources(root: Path, problems: list[Problem]) -> dict[str, list[Source]]:
    """Every readable, non-empty YAML file of each kind's folder, in name order."""
    out: dict[str, list[Source]] = {k: [] for k in KINDS}
    for kind in KINDS:
        folder = root / kind
        if not folder.is_dir():
            continue
        files = sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml"))
        for path in files:
            src = read_one(path, problems)
            if src is not None:
                out[kind].append(src)
    return out


def read_one(path: Path, problems: list[Problem]) -> Source | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        problems.append(Problem(str(path), 1, 1, f"cannot read: {e}"))
        return None
    try:
        doc = read_yaml(text, str(path))
    except YamlProblem as e:
        problems.append(Problem(str(path), e.mark.line, e.mark.column, e.message))
        return None
    if doc.data is None:
        problems.append(Problem(str(path), 1, 1, "empty file"))
        return None
    return Source(path, doc, problems)
