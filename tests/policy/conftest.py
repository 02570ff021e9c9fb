"""Helpers: write a throwaway rules directory from YAML snippets."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from stockade.policy import RuleSet, load_rules

WriteRules = Callable[..., Path]


@pytest.fixture
def write_rules(tmp_path: Path) -> WriteRules:
    """write_rules(profiles={"p": "yaml"}, presets=..., apis=..., tests=...) -> rules dir."""

    def write(**kinds: dict[str, str]) -> Path:
        root = tmp_path / "rules"
        for kind, files in kinds.items():
            folder = root / kind
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (folder / f"{name}.yaml").write_text(textwrap.dedent(text).lstrip("\n"))
        root.mkdir(exist_ok=True)
        return root

    return write


@pytest.fixture
def load_profile(write_rules: WriteRules) -> Callable[..., RuleSet]:
    """load_profile(yaml_of_profile_p, presets={...}) -> RuleSet."""

    def load(profile_yaml: str, **extra: dict[str, str]) -> RuleSet:
        return load_rules(write_rules(profiles={"p": profile_yaml}, **extra))

    return load
