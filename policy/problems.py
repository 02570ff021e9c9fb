"""Problems found in rule files: errors refuse the rule set, warnings are advice, notes
inform."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int  # 1-based
    column: int  # 1-based
    message: str  # starts with the key path, e.g. "egress.allow[0].host: ..."
    # "note": shown by lint, never a problem (e.g. an entry's explicit accept_fronting)
    severity: Literal["error", "warning", "note"] = "error"

    def __str__(self) -> str:
        tag = "" if self.severity == "error" else f"{self.severity}: "
        return f"{self.file}:{self.line}:{self.column}: {tag}{self.message}"


class RulesError(Exception):
    """The rule set is invalid; `.problems` lists every error with its position."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(problems, key=lambda p: (p.file, p.line, p.column, p.message))
        super().__init__("\n".join(str(p) for p in self.problems))
