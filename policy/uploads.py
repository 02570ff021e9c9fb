"""The catalogue of upload-capable services (policy/upload_services.yaml, shipped with
the code): read and validated once, for lint's upload warnings."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from functools import cache
from pathlib import Path

from .problems import Problem, RulesError
from .schema import UploadCatalogueModel
from .sources import read_one

CATALOGUE = Path(__file__).with_name("upload_services.yaml")


@dataclass(frozen=True, slots=True)
class UploadService:
    """One name pattern of a service that accepts uploads from anyone."""

    host: str  # normalised pattern: a name or "*." + name
    provider: str
    kind: str  # object-store, gist, paste, webhook, raw-content, ...
    source: str
    checked: date

    def __str__(self) -> str:
        return f"{self.host} ({self.kind}: {self.provider}, {self.source})"


def read_catalogue(path: Path) -> tuple[UploadService, ...]:
    """Every name pattern of the catalogue at `path`; RulesError (file:line) when invalid."""
    problems: list[Problem] = []
    src = read_one(path, problems)
    doc = src.validate(UploadCatalogueModel) if src is not None else None
    if doc is None:
        raise RulesError(problems)
    return tuple(UploadService(h, s.provider, s.kind, s.source, s.checked)
                 for s in doc.services for h in s.hosts)  # fmt: skip


@cache
def upload_services() -> tuple[UploadService, ...]:
    """The shipped catalogue (its validity is a test of the suite, not of the user's rules)."""
    return read_catalogue(CATALOGUE)
