"""Golden outputs of every `stockade rules` command on the shipped rules (and on events
decided by them): what a reviewer sees, byte for byte. A change of output is a change of
the golden file in the same commit; regenerate with STOCKADE_UPDATE_GOLDEN=1."""

from __future__ import annotations

import os
import shutil
from datetime import date
from pathlib import Path

import pytest
from stockade.policy import RequestFacts, decide, decide_name, load_rules
from stockade.policy.eventfields import verdict_fields

from stockade.cli import main
from stockade.events import EventWriter, make_event

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden")
TODAY = "2026-12-01"
T0 = 1_796_000_000.0  # 2026-11-30T00:53:20Z: the recorded events' clock, fixed
PROFILE = "pypi-build"


def _event(rs, i: int, action: str, host: str, method: str | None = None,
           path: str | None = None, task: str = "demo-1") -> dict:
    v = decide(rs, PROFILE, RequestFacts(host=host, port=443, method=method, path=path),
               date.fromisoformat(TODAY))  # fmt: skip
    fields = verdict_fields(v)
    if action == "connection_decision" and v.needs_inspection:
        fields.update(decision="allowed", reason="inspected")  # as the pipeline records it
    url = {"scheme": "https", "domain": host, "port": 443, "path": path} if path else None
    return make_event(component="gateway", action=action, task_id=task, profile=PROFILE,
                      destination_domain=host, destination_port=443, http_method=method,
                      url=url, transport="tcp", now=T0 + i, **fields)  # fmt: skip


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    """Two pip installs under the shipped pypi-build profile, one of which also tried
    an upload and an exfiltration; rotated by the writer."""
    rs = load_rules(REPO / "rules")
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, max_bytes=4000, backups=20)
    i = 0
    for task in ("demo-1", "demo-2"):
        for args in (("connection_decision", "pypi.org"),
                     ("request_decision", "pypi.org", "GET", "/simple/idna/"),
                     ("connection_decision", "files.pythonhosted.org"),
                     ("request_decision", "files.pythonhosted.org", "GET",
                      "/packages/ab/idna-3.7-py3-none-any.whl")):  # fmt: skip
            i += 1
            w.write(_event(rs, i, *args, task=task))
    w.write(_event(rs, i + 1, "request_decision", "pypi.org", "POST", "/legacy/"))
    w.write(_event(rs, i + 2, "connection_decision", "evil.test"))
    v = decide_name(rs, PROFILE, "evil.test", date.fromisoformat(TODAY))
    w.write(make_event(component="dns", action="dns_decision", task_id="demo-1",
                       profile=PROFILE, dns_question={"name": "evil.test", "type": "A"},
                       now=T0 + i + 3, **verdict_fields(v)))  # fmt: skip
    w.close()
    assert (tmp_path / "events.jsonl.1").exists()
    return path


@pytest.fixture
def tightened(tmp_path: Path) -> Path:
    """The shipped rules without PyPI's JSON API path, and the file CDN expired."""
    root = tmp_path / "tight"
    shutil.copytree(REPO / "rules", root)
    preset = root / "presets" / "pypi-readonly.yaml"
    text = preset.read_text().replace('paths: ["/simple/**", "/pypi/**"]', 'paths: ["/simple/**"]')
    preset.write_text(text.replace("    id: pypi-files\n",
                                   "    id: pypi-files\n    expires: 2026-01-01\n"))  # fmt: skip
    return root


def check(capsys, monkeypatch, tmp_path: Path, name: str, *argv: str) -> None:
    """`stockade rules ARGV` in the repository (so paths read rules/...) against the golden
    file `name`: exit code, stdout and stderr, temporary paths written as <tmp>."""
    monkeypatch.chdir(REPO)
    rc = main(["rules", *argv])
    out = capsys.readouterr()
    shown = " ".join(a.replace(str(tmp_path), "<tmp>") for a in argv)
    got = (f"$ stockade rules {shown}\n--- exit {rc}\n--- stdout\n{out.out}--- stderr\n"
           f"{out.err}").replace(str(tmp_path), "<tmp>")  # fmt: skip
    golden = GOLDEN / f"{name}.txt"
    if os.environ.get("STOCKADE_UPDATE_GOLDEN") == "1":
        golden.write_text(got)
    assert got == golden.read_text(), f"{name}: output changed (see {golden})"


CASES = {
    "lint": ("lint", "rules", "--today", TODAY),
    "lint-json": ("lint", "rules", "--today", TODAY, "--strict", "--json"),
    "explain-allow": ("explain", "-p", PROFILE, "https://pypi.org/simple/idna/",
                      "--today", TODAY),
    "explain-deny": ("explain", "-p", PROFILE, "-X", "POST", "https://upload.pypi.org/legacy/",
                     "--today", TODAY),
    "explain-dns": ("explain", "-p", "no-network", "--dns", "pypi.org", "--today", TODAY),
    "explain-unknown-profile": ("explain", "-p", "pypi-buidl", "pypi.org:443"),
    "test": ("test", "rules", "--today", TODAY),
    "fmt-check": ("fmt", "--check", "rules"),
    "schema-tests": ("schema", "--kind", "tests"),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_golden_on_the_shipped_rules(capsys, monkeypatch, tmp_path, name):
    check(capsys, monkeypatch, tmp_path, name, *CASES[name])


def test_golden_diff(capsys, monkeypatch, tmp_path, tightened):
    check(capsys, monkeypatch, tmp_path, "diff", "diff", "--today", TODAY, "--exit-code",
          "rules", str(tightened))  # fmt: skip


def test_golden_usage(capsys, monkeypatch, tmp_path, recorded):
    check(capsys, monkeypatch, tmp_path, "usage", "usage", "--rules", "rules", "--events",
          str(recorded), "--since", "all", "--today", TODAY)  # fmt: skip


def test_golden_learn(capsys, monkeypatch, tmp_path, recorded):
    check(capsys, monkeypatch, tmp_path, "learn", "learn", "--events", str(recorded),
          "--task", "demo-1", "--task", "demo-2", "--name", "pip-install")  # fmt: skip


def test_golden_replay(capsys, monkeypatch, tmp_path, recorded, tightened):
    check(capsys, monkeypatch, tmp_path, "replay", "replay", str(tightened), "--events",
          str(recorded), "--today", TODAY)  # fmt: skip
    check(capsys, monkeypatch, tmp_path, "replay-markdown", "replay", str(tightened),
          "--events", str(recorded), "--today", TODAY, "--markdown")  # fmt: skip
