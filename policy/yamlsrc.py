"""Read one YAML rule file into plain data plus the source position of every value.

Hand-written on top of PyYAML's composer because the constructor throws positions away
and silently keeps the last of two duplicate keys; security teams need both an error for
the duplicate and `file:line:column` for every validation error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

Path_ = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Mark:
    line: int  # 1-based
    column: int  # 1-based


class YamlProblem(Exception):
    def __init__(self, message: str, mark: Mark) -> None:
        super().__init__(message)
        self.message = message
        self.mark = mark


@dataclass(slots=True)
class Document:
    data: Any
    marks: dict[Path_, Mark]  # path -> position of that value (or of its key when missing)
    key_marks: dict[Path_, Mark] = field(default_factory=dict)  # path -> position of its key

    def mark_for(self, path: Path_) -> Mark:
        """Position of the deepest existing node on `path` (missing keys -> their parent)."""
        p = tuple(path)
        while p:
            if p in self.marks:
                return self.marks[p]
            p = p[:-1]
        return self.marks.get((), Mark(1, 1))


def _mark(node: yaml.Node) -> Mark:
    return Mark(node.start_mark.line + 1, node.start_mark.column + 1)


# libyaml's parser when present (about 10x faster on large profiles); same nodes and marks
_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_Base):  # type: ignore[misc]
    pass


def read_yaml(text: str, name: str) -> Document:
    """Parse one document; raises YamlProblem for syntax errors and duplicate keys."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        marks: dict[Path_, Mark] = {}
        key_marks: dict[Path_, Mark] = {}
        if node is None:
            return Document(None, {(): Mark(1, 1)})
        data = _convert(loader, node, (), marks, key_marks)
    except yaml.MarkedYAMLError as e:
        m = e.problem_mark or e.context_mark
        mark = Mark(m.line + 1, m.column + 1) if m else Mark(1, 1)
        raise YamlProblem(f"invalid YAML: {e.problem or e.context}", mark) from None
    except yaml.YAMLError as e:
        raise YamlProblem(f"invalid YAML: {e}", Mark(1, 1)) from None
    finally:
        loader.dispose()
    return Document(data, marks, key_marks)


MAX_DEPTH = 32
MAX_NODES = 500_000  # alias bombs ("billion laughs") stop here


def _convert(
    loader: _Loader,
    node: yaml.Node,
    path: Path_,
    marks: dict[Path_, Mark],
    key_marks: dict[Path_, Mark],
) -> Any:
    if len(path) > MAX_DEPTH or len(marks) > MAX_NODES:
        raise YamlProblem("document nested too deeply or too large (alias loop?)", _mark(node))
    marks[path] = _mark(node)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlProblem("mapping keys must be plain scalars", _mark(key_node))
            key = _construct(loader, key_node, path)
            if not isinstance(key, str):
                key = str(key)
            if key in out:
                raise YamlProblem(f"{_dotted((*path, key))}: duplicate key", _mark(key_node))
            key_marks[(*path, key)] = _mark(key_node)
            out[key] = _convert(loader, value_node, (*path, key), marks, key_marks)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [
            _convert(loader, v, (*path, i), marks, key_marks) for i, v in enumerate(node.value)
        ]
    return _construct(loader, node, path)


def _construct(loader: _Loader, node: yaml.Node, path: Path_) -> Any:
    try:
        return loader.construct_object(node)
    except yaml.MarkedYAMLError:
        raise
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as e:
        # e.g. `2020-13-45` resolves to a timestamp the constructor cannot build
        raise YamlProblem(f"{_dotted(path)}: invalid value: {e}", _mark(node)) from None


def _dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


dotted = _dotted
