"""`stockade rules replay`: the traffic of a demo-like pip install, decided by the shipped
rules the way the gateway fills its events, replayed against a tightened and a widened
copy of those rules."""

from __future__ import annotations

import json
import shutil
from datetime import date
from pathlib import Path

import pytest
from stockade.policy import RequestFacts, decide, decide_name, load_rules
from stockade.policy.eventfields import verdict_fields

from stockade.cli import main
from stockade.events import EventWriter, make_event

SHIPPED = Path(__file__).resolve().parents[2] / "rules"
TODAY = date(2026, 12, 1)
PROFILE = "pypi-build"


def _event(rs, action: str, host: str, port: int = 443, method: str | None = None,
           path: str | None = None) -> dict:
    v = decide(rs, PROFILE, RequestFacts(host=host, port=port, method=method, path=path),
               TODAY)  # fmt: skip
    fields = verdict_fields(v)
    if action == "connection_decision" and v.needs_inspection:
        fields.update(decision="allowed", reason="inspected")  # as the pipeline records it
    url = {"scheme": "https", "domain": host, "port": port, "path": path} if path else None
    return make_event(component="gateway", action=action, task_id="demo-1", profile=PROFILE,
                      destination_domain=host, destination_port=port, http_method=method,
                      url=url, transport="tcp", **fields)  # fmt: skip


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    """What the demo's task does: pip install (index and files, inspected), an upload
    attempt, an exfiltration attempt, DNS lookups; plus a throttle's summary and an
    address refusal (decisions the rules did not make). Rotated by the writer."""
    rs = load_rules(SHIPPED)
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, max_bytes=5000, backups=9)
    w.write(_event(rs, "connection_decision", "pypi.org"))
    for _ in range(3):
        w.write(_event(rs, "request_decision", "pypi.org", method="GET", path="/simple/idna/"))
    w.write(_event(rs, "request_decision", "pypi.org", method="GET", path="/pypi/idna/json"))
    w.write(_event(rs, "request_decision", "pypi.org", method="POST", path="/simple/idna/"))
    w.write(_event(rs, "connection_decision", "files.pythonhosted.org"))
    w.write(_event(rs, "request_decision", "files.pythonhosted.org", method="GET",
                   path="/packages/ab/idna-3.7-py3-none-any.whl"))  # fmt: skip
    w.write(_event(rs, "connection_decision", "upload.pypi.org"))
    w.write(_event(rs, "connection_decision", "evil.test"))
    v = decide_name(rs, PROFILE, "evil.test", TODAY)
    w.write(make_event(component="dns", action="dns_decision", task_id="demo-1",
                       profile=PROFILE, dns_question={"name": "evil.test", "type": "A"},
                       **verdict_fields(v)))  # fmt: skip
    w.write(make_event(component="gateway", action="connection_decision", decision="denied",
                       reason="address_forbidden", task_id="demo-1", profile=PROFILE,
                       destination_domain="pypi.org", destination_port=443))  # fmt: skip
    w.close()
    assert (tmp_path / "events.jsonl.1").exists()
    return path


def _candidate(tmp_path: Path, name: str, edit) -> Path:
    root = tmp_path / name
    shutil.copytree(SHIPPED, root)
    preset = root / "presets" / "pypi-readonly.yaml"
    preset.write_text(edit(preset.read_text()))
    return root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["rules", "replay", "--today", "2026-12-01", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_replay_against_the_same_rules_changes_nothing(capsys, recorded):
    rc, out, err = run(capsys, str(SHIPPED), "--events", str(recorded), "--json")
    data = json.loads(out)
    assert rc == 0, err
    assert data["newly_allowed"] == [] and data["newly_denied"] == []
    assert data["decisions"] == 11 and data["unchanged"] == 11 and data["not_rule_decisions"] == 1
    assert len(data["files"]) >= 2


def test_tightened_rules_newly_deny(capsys, recorded, tmp_path):
    # the JSON API path goes, so does the file CDN
    def tighten(text: str) -> str:
        text = text.replace('paths: ["/simple/**", "/pypi/**"]', 'paths: ["/simple/**"]')
        files = "    id: pypi-files\n"
        return text.replace(files, files + "    expires: 2026-01-01\n")

    tight = _candidate(tmp_path, "tight", tighten)
    rc, out, _ = run(capsys, str(tight), "--events", str(recorded), "--fail-on-new-allow")
    assert rc == 0  # nothing newly allowed
    lines = out.splitlines()
    assert lines[0].startswith("11 rule decision(s) replayed")
    assert "0 flow(s) newly allowed, 3 newly denied" in lines[0]
    assert ("- pypi-build: request GET pypi.org:443/pypi/idna/json (1 event(s)) "
            "[path_not_allowed; was pypi-index]") in lines
    assert ("- pypi-build: connection files.pythonhosted.org:443 (1 event(s)) "
            "[no_matching_rule; was pypi-files]") in lines
    assert any(x.startswith("- pypi-build: request GET files.pythonhosted.org") for x in lines)
    assert len(lines) == 4


def test_widened_rules_newly_allow_and_fail_ci(capsys, recorded, tmp_path):
    def widen(text: str) -> str:
        text = text.replace("methods: [GET, HEAD]\n", "methods: [GET, HEAD, POST]\n")
        oops = "  - {host: evil.test, id: oops, reason: a careless widening}\n"
        return text.replace("allow:\n", "allow:\n" + oops, 1)

    wide = _candidate(tmp_path, "wide", widen)
    rc, out, _ = run(capsys, str(wide), "--events", str(recorded), "--fail-on-new-allow",
                     "--json")  # fmt: skip
    assert rc == 1
    data = json.loads(out)
    got = {(c["kind"], c["target"], c["entry_now"], c["events"]) for c in data["newly_allowed"]}
    assert got == {("request", "POST pypi.org:443/simple/idna/", "pypi-index", 1),
                   ("connection", "evil.test:443", "oops", 1),
                   ("dns", "evil.test", "oops", 1)}  # fmt: skip
    assert data["newly_denied"] == []
    rc, md, _ = run(capsys, str(wide), "--events", str(recorded), "--markdown")
    assert rc == 0
    assert "#### Newly allowed (3)" in md and "#### Newly denied (0)" in md
    assert "| `pypi-build` | connection `evil.test:443` | 1 | `oops` | `allowed_by_rule` |" in md


def test_replay_bad_input(capsys, recorded, tmp_path):
    assert run(capsys, str(tmp_path / "nope"), "--events", str(recorded))[0] == 2
    rc, _, err = run(capsys, str(SHIPPED), "--events", str(tmp_path / "none"))
    assert rc == 2 and "no events file" in err
    assert run(capsys, str(SHIPPED), "--events", str(recorded), "--since", "x")[0] == 2
