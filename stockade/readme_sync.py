"""Keeps the README's reference sections generated from their sources of truth.

`python -m stockade.readme_sync` rewrites the blocks between markers; the test suite
fails when the README is out of date (tests/core/test_readme.py).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rules_reference() -> str:
    """docs/rules.md from 'Values' up to the decision walk-through, headings one level down."""
    text = (ROOT / "docs" / "rules.md").read_text()
    start = text.index("## Values")
    end = text.index("## How a request is decided")
    body = text[start:end].rstrip()
    return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", body, flags=re.M)


def _blocks() -> dict[str, Callable[[], str]]:
    from stockade import cli_doc, config_doc

    return {
        "config-reference": config_doc.reference_markdown,
        "cli-reference": cli_doc.reference_markdown,
        "rules-reference": _rules_reference,
    }


def render(readme: str) -> str:
    for name, make in _blocks().items():
        pattern = re.compile(
            rf"(<!-- {name}:begin[^>]*-->\n)(.*?)\n?(<!-- {name}:end -->)", flags=re.S
        )
        if not pattern.search(readme):
            raise ValueError(f"README has no {name} markers")
        content = make()
        readme = pattern.sub(lambda m, c=content: m.group(1) + c + "\n" + m.group(3), readme)
    return readme


def main() -> int:
    path = ROOT / "README.md"
    old = path.read_text()
    new = render(old)
    if new != old:
        path.write_text(new)
        print("README.md updated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
