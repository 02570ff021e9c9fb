"""An embedded stack leaves out the L7 inspector when no entry of its rules needs it, and
the dev OpenBao when no profile grants a broker API and no secret is to be put
(stockade/stack/lean.py), each only when the configuration leaves that to the defaults."""

from __future__ import annotations

import sys
from pathlib import Path

from stockade.policy import load_rules

from stockade.config import Config

# the demo API definition the e2e instance's profile grants (its key is in Vault)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_instance import API

from stockade.stack.lean import (
    inspection_needed,
    vault_needed,
    without_unneeded_inspector,
    without_unneeded_vault,
)

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


GRANTING = PLAIN.replace("profile: plain", "profile: caller") + """\
broker:
  apis:
    demo-api:
      operations:
        - {method: GET, path: "/v1/whoami"}
"""
def test_no_broker_grant_no_dev_vault(tmp_path: Path) -> None:
    rules = _rules(tmp_path, PLAIN)
    lean = without_unneeded_vault(Config(), rules, secrets=False)
    assert not lean.dev_vault.enabled and not vault_needed(rules)
    # secrets to put, on the command line or in the config, keep it
    assert without_unneeded_vault(Config(), rules, secrets=True).dev_vault.enabled
    with_file = Config.model_validate(
        {"dev_vault": {"secrets": [{"path": "a/b", "field": "f", "file": "/dev/null"}]}})
    assert without_unneeded_vault(with_file, rules, secrets=False).dev_vault.enabled


def test_a_broker_grant_or_the_configs_word_keeps_the_vault(tmp_path: Path) -> None:
    (tmp_path / "apis").mkdir(parents=True)
    (tmp_path / "apis" / "demo-api.yaml").write_text(API)
    rules = _rules(tmp_path, PLAIN, GRANTING)
    assert vault_needed(rules)
    assert without_unneeded_vault(Config(), rules, secrets=False).dev_vault.enabled
    plain = _rules(tmp_path / "plain", PLAIN)
    said = Config.model_validate({"dev_vault": {"enabled": True}})
    assert without_unneeded_vault(said, plain, secrets=False).dev_vault.enabled
    configured = Config.model_validate({"vault": {"address": "https://vault.example:8200",
                                                  "token_file": "/dev/null"}})
    assert without_unneeded_vault(configured, plain, secrets=False) is configured
