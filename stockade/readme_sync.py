"""Keeps the generated reference pages in docs/reference/ current with their sources of truth.

`python -m stockade.readme_sync` rewrites the blocks between markers in each file of
`FILES`; the test suite fails when one is out of date (tests/core/test_readme.py).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each reference page and the generated blocks it must carry.
FILES: dict[str, tuple[str, ...]] = {
    "docs/reference/cli.md": ("cli-reference",),
    "docs/reference/config.md": ("config-reference",),
    "docs/reference/rules.md": ("rules-reference",),
}


def _rules_reference() -> str:
    """docs/rules.md from 'Values' up to the decision walk-through."""
    text = (ROOT / "docs" / "rules.md").read_text()
    start = text.index("## Values")
    end = text.index("## How a request is decided")
    return text[start:end].rstrip()


def _blocks() -> dict[str, Callable[[], str]]:
    from stockade import cli_doc, config_doc

    return {
        "config-reference": config_doc.reference_markdown,
        "cli-reference": cli_doc.reference_markdown,
        "rules-reference": _rules_reference,
    }


def render(text: str, required: Iterable[str] = ()) -> str:
    """`text` with every generated block it carries rewritten; a block named in
    `required` must be there (a page that lost its markers must not pass as current)."""
    required = set(required)
    for name, make in _blocks().items():
        pattern = re.compile(
            rf"(<!-- {name}:begin[^>]*-->\n)(.*?)\n?(<!-- {name}:end -->)", flags=re.S
        )
        if not pattern.search(text):
            if name in required:
                raise ValueError(f"no {name} markers")
            continue
        content = make()
        text = pattern.sub(lambda m, c=content: m.group(1) + c + "\n" + m.group(3), text)
    return text


def main() -> int:
    for rel, blocks in FILES.items():
        path = ROOT / rel
        old = path.read_text()
        new = render(old, blocks)
        if new != old:
            path.write_text(new)
            print(f"{rel} updated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
