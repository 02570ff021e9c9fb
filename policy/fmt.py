"""`stockade rules fmt`'s core: one rule file's text in, its canonical text out.

Canonical is: the keys of every mapping in the order of the file's model (schema.py:
the name first, then as docs/rules.md lists them; keys the model does not know stay
last, as written), block mappings indented by two, block sequences by two more with
the dash at the mapping's indentation ("  - host: ..."), one newline at the end.
Comments, flow or block style and the quoting of each value are the author's and are
kept (ruamel.yaml's round trip). The result must mean exactly what the input meant,
read the way the loader reads it (PyYAML): otherwise the file is refused, not changed.
"""

from __future__ import annotations

import io
from typing import Any

from pydantic import BaseModel
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from .schemawalk import nested_model
from .yamlsrc import YamlProblem, read_yaml


class FmtError(Exception):
    """A file fmt cannot format (left as it is): the message and its 1-based position."""

    def __init__(self, message: str, line: int = 1, column: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column


def _yaml() -> YAML:
    y = YAML()  # round trip: comments, styles and quotes survive
    y.indent(mapping=2, sequence=4, offset=2)
    y.preserve_quotes = True
    y.width = 4096  # never re-wrap a long value: line breaks are the author's
    return y


def format_text(text: str, model: type[BaseModel]) -> str:
    """The canonical form of `text`, a rule file of `model`; raises FmtError."""
    try:
        data = _yaml().load(text)
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise FmtError(f"invalid YAML: {e.problem or e.context}", *where) from None
    except YAMLError as e:
        raise FmtError(f"invalid YAML: {e}") from None
    if not isinstance(data, CommentedMap):
        raise FmtError("expected a mapping at the top level")
    _reorder(data, model)
    out = io.StringIO()
    _yaml().dump(data, out)
    result = out.getvalue()
    _same_meaning(text, result)
    return result


def _reorder(node: Any, model: type[BaseModel] | None) -> None:
    """Put every mapping's keys in `model`'s field order, down the whole document."""
    if model is None:
        return
    if isinstance(node, CommentedSeq):
        for item in node:
            _reorder(item, model)
        return
    if not isinstance(node, CommentedMap):
        return
    rank = {name: i for i, name in enumerate(model.model_fields)}
    ordered = sorted(node, key=lambda k: rank.get(k, len(rank)))  # stable: unknown stay
    if ordered != list(node):
        for key in ordered:
            node.move_to_end(key)
    for key, value in node.items():
        _reorder(value, nested_model(model, key) if isinstance(key, str) else None)


def _same_meaning(before: str, after: str) -> None:
    """Refuse a result the loader would read differently (a YAML 1.1 / 1.2 difference,
    a value ruamel.yaml re-emits in another form)."""
    try:
        old = read_yaml(before, "before").data
        new = read_yaml(after, "after").data
    except YamlProblem as e:
        raise FmtError(e.message, e.mark.line, e.mark.column) from None
    if old != new:
        raise FmtError("formatting would change what the file means to the loader; "
                       "left unchanged (please report this file)")  # fmt: skip
