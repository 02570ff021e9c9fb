"""The README is the newcomer's entry point: it and the generated reference pages in
docs/reference/ must match the code, and its test command must be exactly what CI runs."""

import re
from pathlib import Path

import pytest

from stockade import readme_sync
from stockade.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_generated_sections_are_current():
    readme = (ROOT / "README.md").read_text()
    assert readme_sync.render(readme) == readme, (
        "README is stale: run .venv/bin/python -m stockade.readme_sync"
    )


@pytest.mark.parametrize(("rel", "blocks"), sorted(readme_sync.FILES.items()))
def test_reference_pages_are_current(rel, blocks):
    page = (ROOT / rel).read_text()
    assert readme_sync.render(page, blocks) == page, (
        f"{rel} is stale: run .venv/bin/python -m stockade.readme_sync"
    )


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^bash scripts/\S+", ci, flags=re.M)
    assert commands == ["bash scripts/test.sh"]
    assert "bash scripts/test.sh" in readme and "bash scripts/demo.sh" in readme


def test_every_command_is_documented():
    readme = (ROOT / "README.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in sub.choices:
        assert f"`stockade {name}" in readme, name
