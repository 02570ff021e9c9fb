"""The pre-commit hook definitions (.pre-commit-hooks.yaml): their entries run, pass on
the shipped rules and fail on broken ones, and their file patterns pick the rule files."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
HOOKS = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
# the console script the package installs (pre-commit's `language: python` installs it)
STOCKADE = Path(sys.executable).with_name("stockade")


def _run(hook: dict, cwd: Path) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(hook["entry"]) + list(hook.get("args", []))
    assert argv[0] == "stockade"
    return subprocess.run([str(STOCKADE), *argv[1:]], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


def test_the_hooks_are_declared():
    assert [h["id"] for h in HOOKS] == ["stockade-rules-lint", "stockade-rules-test",
                                        "stockade-rules-fmt"]  # fmt: skip
    for h in HOOKS:
        assert {"id", "name", "entry", "language"} <= set(h), h
        assert h["language"] == "python" and h["pass_filenames"] is False


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h["id"])
def test_the_file_pattern_picks_rule_files(hook):
    pattern = re.compile(hook["files"])
    shipped = [str(p.relative_to(REPO)) for p in (REPO / "rules").glob("*/*.yaml")]
    assert shipped and all(pattern.search(p) for p in shipped)
    for other in ("README.md", "policy/lint.py", "deploy/stockade.yaml", "rules/schema.json"):
        assert not pattern.search(other), other


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository of rule files: a copy of the shipped ones under ./rules."""
    shutil.copytree(REPO / "rules", tmp_path / "rules")
    return tmp_path


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h["id"])
def test_each_hook_passes_on_the_shipped_rules(hook, repo):
    proc = _run(hook, repo)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_each_hook_fails_on_what_it_checks(repo):
    lint, test, fmt = HOOKS
    profile = repo / "rules" / "profiles" / "npm-build.yaml"
    text = profile.read_text()
    # fmt: the same profile with its first two keys swapped
    first, second, rest = text.split("\n", 2)
    profile.write_text(f"{second}\n{first}\n{rest}")
    proc = _run(fmt, repo)
    assert proc.returncode == 1 and "npm-build.yaml: not canonical" in proc.stdout
    # test: the profile loses its preset, so its policy tests' allows fail
    profile.write_text(text.replace("npm-readonly, ", "").replace("[npm-readonly]", "[]"))
    proc = _run(test, repo)
    assert proc.returncode == 1 and "FAIL" in proc.stdout, proc.stdout + proc.stderr
    # lint: an unknown key
    profile.write_text(text.replace("egress:", "egres:"))
    proc = _run(lint, repo)
    assert proc.returncode == 1 and "egres: unknown key; did you mean 'egress'?" in proc.stdout
