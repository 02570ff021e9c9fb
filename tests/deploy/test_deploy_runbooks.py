"""docs/runbooks.md: one complete section per alert, and every `stockade events` query in
it runs (the real CLI, then the page's own jq pipeline) and finds the events its alert is
about in an events file built by the components' event builders."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import RULES_FILE, RUNBOOKS, tool
from sample_events import broker_call, bypass_attempt, denial, dns_decision
from stockade.broker.audit import reload_refused_event, vault_status_event
from stockade.policy.holder import RulesHolder

from stockade.cli import build_parser
from stockade.events import make_event

PARTS = ("**Means.**", "**First checks.**", "**Events.**", "**Remedy.**")
_FENCE = re.compile(r"^```sh\n(.*?)^```", flags=re.S | re.M)


def _sections() -> dict[str, str]:
    """`## Name` heading -> the text up to the next `## ` heading."""
    chunks = re.split(r"^## (\S.*)$", RUNBOOKS.read_text(), flags=re.M)
    return dict(zip(chunks[1::2], chunks[2::2], strict=True))


def _alert_names() -> list[str]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [r["alert"] for g in groups for r in g["rules"] if "alert" in r]


def _commands(text: str) -> list[str]:
    """The shell commands of the section's sh blocks, continuation lines joined."""
    out = []
    for block in _FENCE.findall(text):
        out += [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    for c in out:
        shlex.split(c)  # a quote left open: the command spans lines, which bash would not run
    return out


def test_every_alert_has_one_complete_section_and_no_section_is_stale() -> None:
    sections = _sections()
    alerts = _alert_names()
    runbooks = [s for s in sections if s.startswith("Stockade")]
    assert sorted(runbooks) == sorted(alerts)
    for name in alerts:
        text = sections[name]
        positions = [text.find(p) for p in PARTS]
        assert -1 not in positions, f"{name}: lacks one of {PARTS}"
        assert positions == sorted(positions), f"{name}: parts out of order"
        assert any(c.startswith("stockade events") for c in _commands(text)), name


# -- the queries, run on real events ---------------------------------------------------------
def _rules_reload_refused(tmp: Path) -> dict[str, Any]:
    """The gateway's own event for a refused reload: a RulesHolder on a broken file."""
    (tmp / "profiles").mkdir(parents=True)
    (tmp / "profiles" / "broken.yaml").write_text("name: broken\negress: [\n")
    got: list[dict[str, Any]] = []
    RulesHolder(tmp, got.append).reload("sighup")
    assert got and got[0]["event"]["action"] == "rules_reload", got
    return got[0]


def _events(tmp: Path) -> list[dict[str, Any]]:
    """One event for each situation an alert's runbook looks for."""
    task = {"task_id": "t-1", "profile": "pypi-build"}
    dns = {"decision": "denied", **task, "source_ip": "10.213.0.2", "transport": "udp"}
    call = {"decision": "denied", **task, "http_method": "GET", "url": {"path": "/user"}}
    return [
        denial(reason="destination_mismatch", destination_domain="pypi.org"),
        make_event(component="gateway", action="request_decision", decision="denied",
                   reason="destination_mismatch", **task, extra={"request_host": "evil.test"}),
        denial(reason="address_forbidden", destination_ip="169.254.169.254",
               message="address category metadata"),
        denial(reason="sni_missing"),
        denial(reason="unknown_task", task_id=None, profile=None, source_ip="10.213.9.9"),
        _rules_reload_refused(tmp / "rules"),
        make_event(component="gateway", action="events_lost", extra={"lost": 3, "lost_total": 3}),
        make_event(component="stack", action="component_restarted", reason="component_exited",
                   extra={"service": "gateway", "restarts": 1}),
        dns_decision("a9f3k2j4h5g6f7d8.evil.example", "TXT", reason="high_entropy_label", **dns),
        dns_decision("pypi.org", "A", reason="query_rate_exceeded", **dns,
                     extra={"suppressed_events": 40}),
        dns_decision("pypi.org", "A", reason="resolve_failed", **dns,
                     extra={"resolve_error": "timeout"}),
        make_event(component="dns", action="dns_decision", reason="malformed_query", **dns,
                   extra={"suppressed_events": 12}),
        vault_status_event("down", "ConnectionError"),
        broker_call(reason="vault_unavailable", **call, extra={"api": "github"}),
        make_event(component="broker", action="secret_echo", **task, http_method="GET",
                   url={"path": "/debug"}, extra={"api": "github", "scrubs": 1}),
        broker_call(reason="operation_not_allowed", **call, extra={"api": "github"}),
        broker_call(reason="upstream_error", **call, extra={"api": "github"}),
        make_event(component="broker", action="events_lost", extra={"lost": 2, "lost_total": 2}),
        reload_refused_event("abc123", "sighup", ["profiles/x.yaml: unknown key"]),
        bypass_attempt(reason="bypass_attempt", **task, rule_id="launcher:blocked",
                       source_ip="10.213.0.2", destination_ip="8.8.8.8", destination_port=443,
                       transport="udp"),
    ]


def _run_events_cli(argv: list[str], events_file: Path) -> str:
    """`stockade events ...` in this process, through the real parser and command."""
    args = build_parser().parse_args([*argv, "--file", str(events_file)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0, argv
    return out.getvalue()


@pytest.fixture(scope="module")
def events_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("runbooks")
    path = tmp / "events.jsonl"
    path.write_text("".join(json.dumps(ev) + "\n" for ev in _events(tmp)))
    return path


QUERIES = [
    (name, c)
    for name, text in _sections().items()
    if name.startswith("Stockade")
    for c in _commands(text)
    if c.startswith("stockade events")
]


@pytest.mark.parametrize(("alert", "command"), QUERIES, ids=[q[0] for q in QUERIES])
def test_runbook_query_finds_the_alerts_events(alert: str, command: str, events_file: Path) -> None:
    jq = tool("jq", "STOCKADE_JQ")
    head, _, rest = command.partition(" | ")
    out = _run_events_cli(shlex.split(head)[1:], events_file)
    if rest:
        if jq is None:
            pytest.skip("jq not installed (Debian: jq; or set STOCKADE_JQ)")
        pipeline = re.sub(r"(^|\| )jq ", lambda m: f"{m.group(1)}{shlex.quote(jq)} ", rest)
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline],
                              input=out, capture_output=True, text=True, check=False)
        assert proc.returncode == 0 and not proc.stderr, f"{alert}: {rest}\n{proc.stderr}"
        out = proc.stdout
    assert out.strip(), f"{alert}: `{command}` finds nothing in events of its own situation"
