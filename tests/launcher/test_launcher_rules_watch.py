"""`stockade launcher serve` reloads its rules when a file under rules_dir changes, as the
gateway and the broker do (the same change detection, stockade.policy.holder), so a
kubelet ConfigMap swap reaches every component without a SIGHUP; a broken file is refused
and the rules in force stay. Its events go to stdout when events.stdout says so (the Helm
chart's pods)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from polling import eventually
from stockade.launcher import SandboxSpec
from stockade.launcher.service import LauncherService

from stockade.config import Config
from stockade.events import read_events

from .test_launcher_service import PROFILE, Served, served  # noqa: F401 - the fixture

pytestmark = pytest.mark.netns


def test_a_changed_rules_directory_is_reloaded_without_sighup(served: Served) -> None:  # noqa: F811
    c = served.client
    before = c.health()["rules"]
    (served.rules / "profiles" / "watched.yaml").write_text(PROFILE.format(name="watched"))
    assert eventually(lambda: c.health()["rules"] != before, 30), served.err.read_text()
    assert c.run(SandboxSpec("watched", ["true"])).exit_code == 0
    after = c.health()["rules"]
    # a broken file: refused by the watch, the rules in force stay
    broken = served.rules / "profiles" / "watched-broken.yaml"
    broken.write_text("profile: broken\nlimits: [not, a, mapping\n")
    try:
        assert eventually(lambda: refused(served), 30), "no refused reload event"
        assert c.health()["rules"] == after
    finally:
        broken.unlink()


def refused(svc: Served) -> bool:
    """A `rules_reload` refusal triggered by the file watch is in the events file."""
    path = svc.config.events.file
    return path is not None and any(
        e["event"]["action"] == "rules_reload" and e["event"]["reason"] == "rules_invalid"
        and '"file_change"' in json.dumps(e) for e in read_events(path))


@pytest.mark.parametrize("stdout", [True, False])
def test_the_service_writes_events_to_stdout_as_configured(tmp_path: Path, stdout: bool) -> None:
    """A pod's log agent reads stdout (the Helm chart sets events.stdout: true)."""
    d = str(tmp_path)
    cfg = Config.model_validate({"log_dir": d, "state_dir": d, "run_dir": d,
                                 "events": {"stdout": stdout}})
    svc = LauncherService(cfg)
    try:
        assert svc.events.stdout is stdout
    finally:
        svc.events.close()
