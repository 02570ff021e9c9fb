"""`stockade rules learn`, `usage` and `replay` on the events of real `stockade run`s
against the fake internet: learn after runs in report mode (the proposal names what the
runs reached, and loads as a profile); usage and replay after an enforced run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from gw_config import write_profiles
from stockade.policy import load_rules

# the e2e suite's self-contained instance (own run_dir, base_port, host-wide names)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_instance import instance_config, write_config

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]

# nothing allowed, but nothing enforced either: every flow is logged with report_only
PROFILE = """\
profile: rec
description: recording a task's traffic for rules learn
limits: {memory: 256MiB, pids: 64, ttl: 60s}
egress:
  mode: report
"""


@pytest.fixture
def run_config(tmp_path: Path, fake_internet) -> Path:
    data = instance_config(tmp_path, fake_internet)
    (Path(data["rules_dir"]) / "profiles" / "rec.yaml").write_text(PROFILE)
    return write_config(tmp_path, data)


def _run(config: Path, ca: str, script: str, profile: str = "rec") -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "stockade", "run", "--config", str(config), "--profile", profile,
         "--json", "--input", f"{ca}:/input/ca.pem", "--", "sh", "-c", script],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.stdout, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["ended_by"] == "exit", result
    return result["task_id"]


@pytest.mark.timeout(600)
def test_learn_from_two_report_mode_runs(run_config, fake_internet, tmp_path):
    ca = str(fake_internet.ca_pem)
    common = "curl -s --max-time 10 --cacert /input/ca.pem https://allowed.test/ ;"
    t1 = _run(run_config, ca, common)
    t2 = _run(run_config, ca, common + " curl -s --max-time 10 --cacert /input/ca.pem "
                                       "https://denied.test/")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "stockade", "rules", "learn", "--config", str(run_config),
         "--task", t1, "--task", t2, "--name", "learned"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert '- host: "allowed.test"' in out
    assert "# not proposed (too few tasks): denied.test:443 (1 of 2 tasks)" in out
    rules = write_profiles(tmp_path / "learned", {"learned": out})
    entries = load_rules(rules).profiles["learned"].allow
    assert [(e.host, sorted(e.ports), e.reason) for e in entries] == [
        ("allowed.test", [443], "TODO")]


def _rules(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stockade", "rules", *argv],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


@pytest.fixture
def rotating_config(tmp_path: Path, fake_internet) -> Path:
    """The instance with an events file that rotates after a few lines, kept whole."""
    data = instance_config(tmp_path, fake_internet, events={"max_bytes": 4096, "backups": 200})
    return write_config(tmp_path, data)


def _without(rules: Path, root: Path, cut: str, until: str) -> Path:
    """A copy of `rules` whose e2e profile lacks the lines from `cut` up to `until`."""
    shutil.copytree(rules, root)
    profile = root / "profiles" / "e2e.yaml"
    text = profile.read_text()
    profile.write_text(text[:text.index(cut)] + text[text.index(until):])
    return root


def _widened(rules: Path, root: Path) -> Path:
    """A copy of `rules` whose e2e profile also allows denied.test."""
    shutil.copytree(rules, root)
    profile = root / "profiles" / "e2e.yaml"
    text = profile.read_text()
    profile.write_text(text.replace("    - host: echo.test", "    - host: denied.test\n"
                                    "      ports: [443]\n      reason: widened\n"
                                    "    - host: echo.test"))  # fmt: skip
    return root


def _replay(candidate: Path, config: Path, rc: int) -> tuple[set, set]:
    """(newly allowed, newly denied) flows of `rules replay --fail-on-new-allow`, which
    must exit `rc`; each flow as (kind, target)."""
    proc = _rules("replay", str(candidate), "--config", str(config), "--json",
                  "--fail-on-new-allow")  # fmt: skip
    assert proc.returncode == rc, proc.stderr
    data = json.loads(proc.stdout)
    return tuple({(c["kind"], c["target"]) for c in data[k]}  # type: ignore[return-value]
                 for k in ("newly_allowed", "newly_denied"))  # fmt: skip


@pytest.mark.timeout(600)
def test_usage_and_replay_after_an_enforced_run(rotating_config, fake_internet, tmp_path):
    """The events of a real run (rotated by the stack's own writers): usage per entry, and
    replays against a tightened and a widened copy of the rules."""
    ca = str(fake_internet.ca_pem)
    curl = "curl -s --max-time 10 --cacert /input/ca.pem"
    task = _run(rotating_config, ca, f"{curl} https://allowed.test/ ; {curl} "
                f"https://echo.test/echo ; {curl} https://denied.test/", profile="e2e")  # fmt: skip
    assert (tmp_path / "log" / "events.jsonl.1").exists(), "the events file rotated"
    rules = tmp_path / "rules"
    proc = _rules("usage", "--config", str(rotating_config), "--rules", str(rules), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["files"]) > 1, report["files"]
    rows = {(u["profile"], u["entry"]): u for u in report["entries"]}
    site = rows[("e2e", "e2e:allow:allowed.test")]
    assert site["hits"] >= 1 and site["tasks"] == 1 and site["bytes_down"] > 0
    assert rows[("e2e", "e2e:allow:echo.test")]["hits"] >= 1  # handed to the inspector
    assert rows[("e2e", "broker:demo-api")]["status"] == ["unused"]
    # tightened: without allowed.test, that flow (and its name) would now be denied
    tight = _without(rules, tmp_path / "tight", "    - host: allowed.test", "    - host: echo.test")
    allowed, denied = _replay(tight, rotating_config, 0)
    assert not allowed and ("connection", "allowed.test:443") in denied, (task, denied)
    # widened: denied.test allowed, so the recorded denial (its DNS lookup: curl got no
    # address, so never connected) would now pass: CI fails
    wide = _widened(rules, tmp_path / "wide")
    allowed, denied = _replay(wide, rotating_config, 1)
    assert (allowed, denied) == ({("dns", "denied.test")}, set()), task
    proc = _rules("replay", str(wide), "--config", str(rotating_config), "--markdown")
    assert proc.returncode == 0 and "denied.test" in proc.stdout, proc.stderr


@pytest.mark.timeout(600)
def test_learn_runs_the_task_itself(run_config, fake_internet, tmp_path):
    """`rules learn --profile rec --runs 2 -- CMD`: two runs in report mode, then the
    proposal from their events (what both needed)."""
    script = ("curl -s --max-time 10 --cacert /input/ca.pem https://allowed.test/ ; "
              "curl -s --max-time 10 --cacert /input/ca.pem https://echo.test/echo")  # fmt: skip
    proc = _rules("learn", "--config", str(run_config), "--profile", "rec", "--runs", "2",
                  "--name", "ran", "--input", f"{fake_internet.ca_pem}:/input/ca.pem",
                  "--", "sh", "-c", script)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("ended by exit, exit 0") == 2, proc.stderr
    rules = write_profiles(tmp_path / "ran", {"ran": proc.stdout})
    entries = load_rules(rules).profiles["ran"].allow
    assert sorted((e.host, sorted(e.ports)) for e in entries) == [
        ("allowed.test", [443]), ("echo.test", [443])]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.timeout(600)
def test_learn_runs_an_enforcing_profile_in_report_mode_on_a_copy(run_config, fake_internet):
    """`--profile e2e` enforces (other.test is not allowed): the task runs against a
    report-mode copy, so other.test is learnt, not denied; the user's rules are as they
    were and the copy is gone."""
    rules_dir = Path(yaml.safe_load(run_config.read_text())["rules_dir"])
    before = _tree(rules_dir)
    copies = set(Path(tempfile.gettempdir()).glob("stockade-learn-rules-*"))
    script = ("curl -s --max-time 10 --cacert /input/ca.pem https://allowed.test/ ; "
              "curl -s --max-time 10 --cacert /input/ca.pem https://other.test/")  # fmt: skip
    proc = _rules("learn", "--config", str(run_config), "--profile", "e2e", "--name", "got",
                  "--input", f"{fake_internet.ca_pem}:/input/ca.pem", "--", "sh", "-c", script)
    assert proc.returncode == 0, proc.stderr
    assert "runs in report mode against a temporary copy" in proc.stderr
    assert '- host: "other.test"' in proc.stdout and '- host: "allowed.test"' in proc.stdout
    assert _tree(rules_dir) == before
    assert set(Path(tempfile.gettempdir()).glob("stockade-learn-rules-*")) == copies


def test_learn_refuses_a_profile_it_cannot_run(run_config):
    proc = _rules("learn", "--config", str(run_config), "--profile", "rek", "--", "true")
    assert proc.returncode == 2 and "unknown profile 'rek'" in proc.stderr
    assert "did you mean 'rec'?" in proc.stderr
    proc = _rules("learn", "--config", str(run_config), "--task", "t1", "--", "true")
    assert proc.returncode == 2 and "-- CMD needs --profile" in proc.stderr
