"""An embedded stack leaves out the L7 inspector when no entry of its rules needs it
(stockade/stack/lean.py), and only when the configuration leaves that to the defaults."""

from __future__ import annotations

from pathlib import Path

from stockade.policy import load_rules

from stockade.config import Config
from stockade.stack.lean import inspection_needed, without_unneeded_inspector

PLAIN = """\
profile: plain
description: no inspected entry
isolation: container
egress:
  mode: enforce
  allow:
    - host: pypi.org
      reason: packages
exports: {max_file: 1MiB, max_total: 2MiB, types: [text]}
"""
INSPECTED = PLAIN.replace("profile: plain", "profile: read").replace(
    "      reason: packages\n",
    "      reason: read-only API\n      http: {methods: [GET], paths: [\"/*\"]}\n")


def _rules(tmp: Path, *profiles: str) -> object:
    for d in ("profiles", "apis", "presets", "tests"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(profiles):
        (tmp / "profiles" / f"p{i}.yaml").write_text(text)
    return load_rules(tmp)


def test_no_inspected_entry_no_inspector(tmp_path: Path) -> None:
    rules = _rules(tmp_path, PLAIN)
    assert not inspection_needed(rules)
    lean = without_unneeded_inspector(Config(), rules)
    assert lean.gateway.inspection.enabled is False
    assert lean.gateway.transparent_listen == Config().gateway.transparent_listen
    # concurrent runs compute the same configuration: they share one stack
    assert lean == without_unneeded_inspector(Config(), rules)


def test_an_inspected_entry_keeps_the_inspector(tmp_path: Path) -> None:
    rules = _rules(tmp_path, PLAIN, INSPECTED)
    assert inspection_needed(rules)
    assert without_unneeded_inspector(Config(), rules).gateway.inspection.enabled


def test_a_configured_choice_is_kept(tmp_path: Path) -> None:
    rules = _rules(tmp_path, PLAIN)
    cfg = Config.model_validate({"gateway": {"inspection": {"enabled": True}}})
    assert without_unneeded_inspector(cfg, rules).gateway.inspection.enabled
