"""The report-mode copy `rules learn -- CMD` runs an enforcing profile against: the
profile switched (the rest of its file kept), the user's directory untouched, a profile
whose copy cannot be made refused with the reason."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from gw_config import write_profiles
from stockade.policy import load_rules
from stockade.policy.learn_copy import CopyError, remove_copy, report_mode_copy

ENFORCING = """\
profile: tight
description: an enforcing profile  # kept in the copy
limits: {ttl: 60s}
egress:
  allow:
    - host: allowed.test
      ports: [443]
      reason: what the task is known to need
"""
NO_EGRESS = """\
profile: bare
description: no egress block at all
"""


def test_the_copy_has_the_profile_in_report_mode(tmp_path: Path) -> None:
    rules = write_profiles(tmp_path / "rules", {"tight": ENFORCING, "bare": NO_EGRESS})
    original = {p: p.read_text() for p in rules.rglob("*.yaml")}
    rs = load_rules(rules)
    for name in ("tight", "bare"):
        copy = report_mode_copy(rules, rs.profiles[name])
        try:
            got = load_rules(copy)
            assert got.profiles[name].mode == "report"
            assert [dataclasses.replace(e, location=None) for e in got.profiles[name].allow] \
                == [dataclasses.replace(e, location=None) for e in rs.profiles[name].allow]
            other = "bare" if name == "tight" else "tight"
            assert got.profiles[other].mode == "enforce"  # only the one profile
            if name == "tight":
                text = (copy / "profiles" / "tight.yaml").read_text()
                assert "# kept in the copy" in text and "mode: report" in text
        finally:
            remove_copy(copy)
        assert not copy.exists() and not copy.parent.exists()
    assert {p: p.read_text() for p in rules.rglob("*.yaml")} == original


def test_a_profile_without_a_file_in_the_directory_is_refused(tmp_path: Path) -> None:
    rules = write_profiles(tmp_path / "rules", {"tight": ENFORCING})
    profile = load_rules(rules).profiles["tight"]
    with pytest.raises(CopyError, match="has no file"):
        report_mode_copy(rules, dataclasses.replace(profile, location=None))
    elsewhere = write_profiles(tmp_path / "elsewhere", {"tight": ENFORCING})
    with pytest.raises(CopyError, match="outside"):
        report_mode_copy(elsewhere / "profiles", profile)


def test_a_copy_that_does_not_come_out_in_report_mode_is_refused(tmp_path: Path) -> None:
    """The profile's file holds something the switch cannot fix (egress not a mapping
    after the original loaded is impossible, so: the file changed under us)."""
    rules = write_profiles(tmp_path / "rules", {"tight": ENFORCING})
    profile = load_rules(rules).profiles["tight"]
    (rules / "profiles" / "tight.yaml").write_text("- not a mapping\n")
    with pytest.raises(CopyError, match="not a mapping"):
        report_mode_copy(rules, profile)
    (rules / "profiles" / "tight.yaml").write_text(ENFORCING.replace("tight", "renamed"))
    with pytest.raises(CopyError, match="not in report mode"):
        report_mode_copy(rules, profile)
