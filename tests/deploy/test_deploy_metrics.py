"""deploy/prometheus and deploy/grafana: every metric and label they query exists in the
code (or in Vector's event-derived metrics), the rules cover what operators must be paged
for, and promtool accepts the rules, their unit tests, the example config and every
dashboard expression (when promtool is installed)."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from deploy_support import (
    DASHBOARD,
    PROMETHEUS_CONFIG,
    RULES_FILE,
    RULES_TEST_FILE,
    RUNBOOKS,
    TARGET_LABELS,
    VECTOR,
    dashboard_exprs,
    grafana_to_promql,
    grouping_labels,
    known_series,
    load_rules,
    recorded_names,
    rule_exprs,
    selectors,
    source_metrics,
    tool,
)

ALL_EXPRS = [("rules", n, e) for n, e in rule_exprs()] + [
    ("dashboard", w, e) for w, e in dashboard_exprs()
]


def _alerts() -> dict[str, dict]:
    return {r["alert"]: r for g in load_rules()["groups"] for r in g["rules"] if "alert" in r}


def test_source_defines_the_metrics_the_components_export() -> None:
    names = set(source_metrics())
    for expected in (
        "stockade_gateway_decisions",
        "stockade_gateway_rule_reloads",
        "stockade_gateway_events_dropped",
        "stockade_dns_queries",
        "stockade_broker_calls",
        "stockade_broker_scrubs",
        "stockade_broker_vault_up",
        "stockade_broker_events_dropped",
        "stockade_broker_rule_reloads",
    ):
        assert expected in names


def test_source_scan_matches_the_live_registries() -> None:
    """The ast scan finds exactly what the metric classes register (names and kinds)."""
    from prometheus_client import CollectorRegistry
    from stockade.broker.metrics import BrokerMetrics
    from stockade.gateway.dns.firewall import DnsMetrics
    from stockade.gateway.metrics import GatewayMetrics

    gw = GatewayMetrics(CollectorRegistry())
    DnsMetrics(gw.registry)
    registries = [gw.registry, BrokerMetrics().registry]
    live = {}
    for reg in registries:
        for fam in reg.collect():
            live[fam.name] = fam.type
    scanned = {m.name: m.kind for m in source_metrics().values()}
    assert {k: v for k, v in scanned.items() if k in live} == live


@pytest.mark.parametrize(("kind", "where", "expr"), ALL_EXPRS, ids=lambda x: str(x)[:60])
def test_every_queried_series_and_label_exists(kind: str, where: str, expr: str) -> None:
    series = known_series()
    recorded = recorded_names()
    sels = selectors(expr)
    assert sels, f"{kind} {where}: queries no Stockade metric: {expr}"
    raw_labels: set[str] = set(TARGET_LABELS)
    for sel in sels:
        if ":" in sel.metric:
            assert sel.metric in recorded, f"{where}: {sel.metric} is recorded by no rule"
            continue
        assert sel.metric in series, f"{kind} {where}: no metric {sel.metric} in the code"
        allowed = series[sel.metric] | TARGET_LABELS
        raw_labels |= allowed
        for label, _op, _value in sel.labels:
            assert label in allowed, f"{where}: {sel.metric} has no label {label!r}"
    if all(":" not in s.metric for s in sels):
        unknown = grouping_labels(expr) - raw_labels
        assert not unknown, f"{where}: grouping by labels no queried metric has: {unknown}"


def test_recording_rule_inputs_keep_their_labels() -> None:
    """An alert that reads a recorded series may only match labels the recording keeps."""
    rules = load_rules()
    kept = {
        r["record"]: grouping_labels(r["expr"])
        for g in rules["groups"]
        for r in g["rules"]
        if "record" in r
    }
    for _name, expr in rule_exprs():
        for sel in selectors(expr):
            if sel.metric in kept:
                for label, _op, _v in sel.labels:
                    assert label in kept[sel.metric], f"{sel.metric} drops {label}"


def test_alerts_cover_what_operators_must_hear_about() -> None:
    alerts = _alerts()
    wanted = {
        "StockadeGatewayDenialSpike": "stockade:gateway_denied:rate5m",
        "StockadeDnsDenialSpike": "stockade:dns_denied:rate5m",
        "StockadeBrokerDenialSpike": "stockade:broker_denied:rate5m",
        "StockadeDomainFronting": "stockade_gateway_decisions_total",
        "StockadeForbiddenAddress": "stockade_gateway_decisions_total",
        "StockadeDnsTunnelling": "stockade_dns_queries_total",
        "StockadeSandboxBypassAttempt": "stockade_events_total",
        "StockadeGatewayRuleReloadFailed": "stockade_gateway_rule_reloads_total",
        "StockadeBrokerRuleReloadFailed": "stockade_broker_rule_reloads_total",
        "StockadeVaultUnavailable": "stockade_broker_vault_up",
        "StockadeSecretEchoScrubbed": "stockade_broker_scrubs_total",
        "StockadeGatewayEventsDropped": "stockade_gateway_events_dropped",
        "StockadeBrokerEventsDropped": "stockade_broker_events_dropped",
    }
    for name, metric in wanted.items():
        assert name in alerts, f"missing alert {name}"
        assert metric in {s.metric for s in selectors(alerts[name]["expr"])}, name


def test_alerts_are_labelled_and_documented() -> None:
    names = []
    for group in load_rules()["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                assert rule["record"].startswith("stockade:")
                continue
            names.append(rule["alert"])
            assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert len(names) == len(set(names))


def test_every_alert_links_its_runbook_section() -> None:
    """runbook_url is docs/runbooks.md#<name lowercased>, and that section exists: an
    alert name is letters and digits only, so GitHub's heading id is the name lowercased."""
    headings = set(re.findall(r"^## (\S+)$", RUNBOOKS.read_text(), flags=re.M))
    for name, rule in _alerts().items():
        assert re.fullmatch(r"[A-Za-z0-9]+", name), name
        url = rule["annotations"].get("runbook_url")
        assert url == f"docs/runbooks.md#{name.lower()}", f"{name}: runbook_url {url!r}"
        assert name in headings, f"{name}: no '## {name}' section in {RUNBOOKS.name}"


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    """The ratchet: an alert added without promtool cases (one where it fires, one
    where it stays quiet) fails here, even where promtool is not installed."""
    cases = [
        c
        for t in yaml.safe_load(RULES_TEST_FILE.read_text())["tests"]
        for c in t.get("alert_rule_test", [])
    ]
    for name in _alerts():
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"{name}: no case where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{name}: no quiet case"
    assert {c["alertname"] for c in cases} <= set(_alerts()), "a case for no alert"


def test_reason_codes_in_rules_exist() -> None:
    """reason/outcome label values the rules match on are real reason codes."""
    from stockade.policy.reasons import Reason

    codes = {r.value for r in Reason} | {"allowed", "denied", "upstream_error"}
    for _name, expr in rule_exprs():
        for sel in selectors(expr):
            for label, op, value in sel.labels:
                if label not in ("reason", "outcome") or sel.metric == "stockade_events_total":
                    continue
                values = value.split("|") if op in ("=~", "!~") else [value]
                for v in values:
                    assert v in codes, f"{sel.metric}{{{label}{op}{value!r}}}: unknown code {v}"


def test_event_metric_labels_are_real_event_fields() -> None:
    from stockade.events.build import _CATEGORY

    for _name, expr in rule_exprs():
        for sel in selectors(expr):
            if sel.metric != "stockade_events_total":
                continue
            for label, _op, value in sel.labels:
                if label == "action":
                    assert value in _CATEGORY, value
                if label == "component":
                    assert value in ("gateway", "dns", "broker", "launcher", "rules"), value
                if label == "decision":
                    assert value in ("allowed", "denied", "none"), value


def test_prometheus_config_scrapes_the_configured_endpoints() -> None:
    from deploy_support import EXAMPLE_CONFIG

    from stockade.config import load_config

    cfg = load_config(EXAMPLE_CONFIG)
    prom = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {
        j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
        for j in prom["scrape_configs"]
    }
    vector = tomllib.loads(VECTOR.read_text())
    exporter = next(s for s in vector["sinks"].values() if s["type"] == "prometheus_exporter")
    assert targets == {
        "stockade-gateway": [cfg.gateway.metrics_listen],
        "stockade-broker": [cfg.broker.metrics_listen],
        "stockade-events": [exporter["address"]],
    }
    assert prom["rule_files"] == [RULES_FILE.name]
    jobs = {
        v for _n, e in rule_exprs() for s in selectors(e) for k, _o, v in s.labels if k == "job"
    }
    assert jobs <= set(targets)


# -- dashboard ------------------------------------------------------------------------------
def test_dashboard_is_valid_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"] for v in dash["templating"]["list"]}
    ids = set()
    for p in dash["panels"]:
        assert p["id"] not in ids
        ids.add(p["id"])
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            for var in ("gateway_job", "broker_job", "events_job", "host"):
                if f"${var}" in t["expr"]:
                    assert var in variables
    # panels do not overlap
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))


def test_dashboard_shows_the_alerted_signals() -> None:
    used = {s.metric for _w, e in dashboard_exprs() for s in selectors(e)}
    for metric in (
        "stockade_gateway_decisions_total",
        "stockade_dns_queries_total",
        "stockade_broker_calls_total",
        "stockade_broker_vault_up",
        "stockade_broker_scrubs_total",
        "stockade_gateway_rule_reloads_total",
        "stockade_gateway_events_dropped",
        "stockade_broker_events_dropped",
        "stockade_events_total",
    ):
        assert metric in used, metric


# -- promtool -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def promtool() -> str:
    path = tool("promtool", "STOCKADE_PROMTOOL")
    if path is None:
        pytest.skip("promtool not installed (Debian: prometheus; or set STOCKADE_PROMTOOL)")
    return path


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)


def test_promtool_check_rules(promtool: str) -> None:
    proc = _run([promtool, "check", "rules", RULES_FILE.name], RULES_FILE.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_rule_unit_tests(promtool: str) -> None:
    proc = _run([promtool, "test", "rules", RULES_TEST_FILE.name], RULES_TEST_FILE.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_check_config(promtool: str) -> None:
    proc = _run([promtool, "check", "config", PROMETHEUS_CONFIG.name], PROMETHEUS_CONFIG.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_exprs_parse_as_promql(promtool: str, tmp_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {"datasource": "prometheus", "host": ".*"}
    for v in dash["templating"]["list"]:
        if v["type"] == "custom":
            variables[v["name"]] = v["query"]
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": grafana_to_promql(e, variables)}
        for i, (_w, e) in enumerate(dashboard_exprs())
    ]
    for r in rules:
        assert "$" not in r["expr"], r["expr"]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = _run([promtool, "check", "rules", path.name], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
