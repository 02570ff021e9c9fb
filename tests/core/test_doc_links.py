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
