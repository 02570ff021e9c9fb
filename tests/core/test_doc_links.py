"""Relative links in the README, bench/README.md and docs/ lead somewhere: to a file that
exists and, for `#anchor` links into Markdown, to a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.*)$", _FENCE.sub("", page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _broken(page: Path) -> list[str]:
    out = []
    for link in re.findall(r"\]\(([^)\s]+)\)", _FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:: not checked offline
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            out.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            out.append(f"{link}: no such heading")
    return out


def test_relative_links_resolve():
    broken = {str(p.relative_to(ROOT)): b for p in PAGES if (b := _broken(p))}
    assert broken == {}


# `path.py` `Name` and `path.py` (`Name`: the module the architecture page names, then a
# name in it; `Class.method` names a method of that class's module. A bare `name.py` is
# relative to the folder its sentence names, so only paths with a folder are checked.
_CITED = re.compile(r"`([\w/]+/\w+\.py)`(?:'s)?\s+\(?`([A-Za-z_][\w.]*)`")
_FILE = re.compile(r"`([\w/]+/\w+\.py)`")


def _defines(source: str, name: str) -> bool:
    for part in name.split("."):
        part = re.escape(part)
        if not re.search(rf"^\s*(?:async\s+def|def|class)\s+{part}\b|^\s*{part}\s*[:=]", source,
                         flags=re.M):
            return False
    return True


def _stale_citations(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())
    out = []
    for path in sorted(set(_FILE.findall(text))):
        if not (ROOT / path).is_file():
            out.append(f"{path}: no such file")
    for path, name in _CITED.findall(text):
        file = ROOT / path
        if file.is_file() and not _defines(file.read_text(), name):
            out.append(f"{path} {name}: not defined there")
    return out


def test_architecture_citations_exist():
    """The data paths of docs/architecture.md name modules and functions that exist."""
    assert _stale_citations(ROOT / "docs" / "architecture.md") == []
