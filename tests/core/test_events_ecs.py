"""Every action's events are valid ECS 9.4.0 (Elastic's own definitions, vendored in
tests/data) and valid schema.json; schema.json's leaves carry their ECS types; each of
ecs_check's rules rejects what it should."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import jsonschema
import pytest
from ecs_check import CUSTOM, load, problems, schema_leaves

from stockade.events import ECS_VERSION, SCHEMA_VERSION, make_event, schema, validate

ECS = load()
NOW = 1_790_000_000.25
NET = {"source_ip": "10.213.0.2", "source_port": 40000, "destination_domain": "x.test",
       "destination_ip": "192.0.2.1", "destination_port": 443, "transport": "tcp",
       "task_id": "t-1", "profile": "p", "policy_version": "v1", "rule_id": "r1"}
SUMMARY = {"action": "dns_decision", "count": 3, "first": "2026-12-01T20:00:00.000000Z",
           "last": "2026-12-01T20:00:01.000000Z", "window_s": 10.0, "budget_exhausted": False}
# action -> (component, kwargs): one realistic event each, as the components build them
SAMPLES: dict[str, tuple[str, dict[str, Any]]] = {
    "connection_decision": ("gateway", {**NET, "protocol": "tls", "extra": {
        "listener": "transparent", "connection_id": 7, "original_destination": "192.0.2.1:443"}}),
    "connection_close": ("gateway", {**NET, "extra": {
        "bytes_up": 10, "bytes_down": 20, "duration_s": 0.25, "connection_id": 7}}),
    "request_decision": ("gateway", {**NET, "http_method": "GET", "url": {
        "scheme": "https", "domain": "x.test", "port": 443, "path": "/a"}, "extra": {
        "connection_id": 7, "listener": "transparent", "inspected": True,
        "http_version": "HTTP/1.1", "request_host": "x.test"}}),
    "dns_decision": ("dns", {"dns_question": {"name": "x.test", "type": "A"},
                             "dns_response_code": "NOERROR", "transport": "udp", "extra": {
        "cname": "y.test", "forbidden_addresses": ["10.0.0.1 private"], "suppressed_events": 2,
        "name_budget": "20/60s"}}),
    "broker_call": ("broker", {"http_method": "POST", "http_status": 403,
                               "url": {"path": "/v1/x"}, "destination_domain": "api.test",
                               "destination_port": 443, "extra": {
        "api": "demo", "status": 403, "bytes_up": 5, "bytes_down": 6, "latency_ms": 1.5,
        "error": "ClientError", "phase": "body", "cut": "budget",
        "address_category": "public"}}),
    "secret_echo": ("broker", {"extra": {"api": "demo", "scrubs": 2}}),
    "bypass_attempt": ("launcher", {"source_ip": "10.213.0.2", "source_port": 5,
                                    "rule_id": "launcher:udp", "extra": {"firewall": "udp"}}),
    "sandbox_lifecycle": ("launcher", {"task_id": "t-1", "extra": {
        "lifecycle": "end", "ended_by": "exit", "duration_s": 3.5, "exit_code": 2,
        "bypass": {"attempts": 1, "logged": 1, "unlogged": 0},
        "event_totals": {"gateway": {"written": 3, "summarised": 1}}}}),
    "export_decision": ("launcher", {"extra": {"export": {
        "name": "out.txt", "size": 12, "type": "text", "why": "too_big"}}}),
    "rules_reload": ("rules", {"extra": {"trigger": "sighup", "previous_version": "v0",
                                         "problems": ["bad rule"]}}),
    "vault_status": ("broker", {"reason": "vault_up"}),
    "event_summary": ("dns", {"extra": {"summary": {**SUMMARY, "kernel_dropped": 3},
                                        "listen": "10.0.0.1:53"}}),
    "event_totals": ("gateway", {"extra": {"totals": {
        "written": 3, "summarised": 1, "bytes": 900, "store_truncated": 0,
        "by": [{"decision": "denied", "reason": "r", "written": 3, "summarised": 1}]}}}),
    "events_lost": ("stack", {"extra": {"lost": 2, "lost_total": 5}}),
    "component_restarted": ("stack", {"extra": {"service": "broker", "exit_code": 1,
                                                "restarts": 1, "delay_s": 0.5}}),
    "chain_checkpoint": ("stack", {"extra": {
        "chain": {"stream": "ab" * 8, "prev": "0" * 64},
        "checkpoint": {"stream": "ab" * 8, "seq": 100, "digest": "f" * 64,
                       "key_id": "0123456789abcdef", "sig": "c2ln"}}}),
}
DECISIONS = (None, "allowed", "denied")


def _event(action: str, decision: str | None) -> dict[str, Any]:
    component, kw = SAMPLES[action]
    return make_event(component=component, action=action, decision=decision,  # type: ignore[arg-type]
                      now=NOW, **{"reason": "r", **copy.deepcopy(kw)})


def test_every_action_of_the_schema_has_a_sample():
    assert set(SAMPLES) == set(schema()["properties"]["event"]["properties"]["action"]["enum"])


@pytest.mark.parametrize("decision", DECISIONS)
@pytest.mark.parametrize("action", sorted(SAMPLES))
def test_every_action_and_decision_is_valid_ecs_and_schema(action, decision):
    ev = _event(action, decision)
    validate(ev)
    assert problems(ev, ECS) == []
    assert ev["ecs"] == {"version": ECS_VERSION} and list(ev)[:2] == ["@timestamp", "ecs"]
    assert ev["stockade"]["schema_version"] == SCHEMA_VERSION == "2.0"


@pytest.mark.parametrize(("action", "decision", "category", "types", "kind", "outcome"), [
    ("connection_decision", "allowed", ["network"], ["connection", "allowed"], "event", "success"),
    ("connection_decision", "denied", ["network"], ["connection", "denied"], "event", "failure"),
    ("connection_decision", None, ["network"], ["info"], "event", None),
    ("connection_close", None, ["network"], ["end", "connection"], "event", None),
    ("request_decision", "denied", ["network"], ["protocol", "denied"], "event", "failure"),
    ("dns_decision", "allowed", ["network"], ["protocol", "allowed"], "event", "success"),
    ("broker_call", "allowed", ["api", "network"], ["access", "allowed"], "event", "success"),
    ("broker_call", "denied", ["api", "network"], ["access", "denied"], "event", "failure"),
    ("secret_echo", None, ["api", "intrusion_detection"], ["info"], "alert", None),
    ("bypass_attempt", "denied", ["network", "intrusion_detection"], ["denied"], "alert",
     "failure"),
    ("sandbox_lifecycle", None, ["process"], ["end"], "event", None),
    ("export_decision", "allowed", ["file"], ["creation"], "event", "success"),
    ("export_decision", "denied", ["file"], ["creation"], "event", "failure"),
    ("rules_reload", "denied", ["configuration"], ["change"], "event", "failure"),
    ("vault_status", None, ["api"], ["info"], "event", "success"),
    ("component_restarted", None, ["process"], ["start"], "event", None),
    ("event_summary", "denied", ["network"], ["protocol", "denied"], "event", "failure"),
    ("event_totals", None, ["file"], ["info"], "event", None),
    ("events_lost", None, ["file"], ["info"], "event", None),
    ("chain_checkpoint", None, ["file"], ["info"], "event", None),
])
def test_category_type_kind_and_outcome_per_action(action, decision, category, types, kind,
                                                   outcome):
    e = _event(action, decision)["event"]
    assert (e["category"], e["type"], e["kind"], e.get("outcome")) == (
        category, types, kind, outcome)


@pytest.mark.parametrize(("lifecycle", "etype"), [
    ("start", "start"), ("end", "end"), ("kill", "change"), ("suspend", "change")])
def test_lifecycle_type_follows_the_lifecycle(lifecycle, etype):
    ev = make_event(component="launcher", action="sandbox_lifecycle",
                    extra={"lifecycle": lifecycle})
    assert ev["event"]["type"] == [etype]


def test_vault_down_is_a_failure():
    ev = make_event(component="broker", action="vault_status", reason="vault_unavailable")
    assert ev["event"]["outcome"] == "failure"


def test_dataset_module_and_observer_per_component():
    for component, kind in (("gateway", "firewall"), ("dns", "firewall"), ("broker", "proxy"),
                            ("launcher", "sandbox"), ("rules", "manager"), ("stack", "manager")):
        ev = make_event(component=component, action="vault_status")  # type: ignore[arg-type]
        assert ev["event"]["dataset"] == f"stockade.{component}"
        assert ev["event"]["module"] == "stockade"
        obs = ev["observer"]
        assert obs["type"] == kind and obs["vendor"] == obs["product"] == "Stockade"
        assert obs["hostname"] and obs["version"]


def test_standard_fields_move_out_of_stockade():
    call = _event("broker_call", "denied")
    assert call["source"]["bytes"] == 5 and call["destination"]["bytes"] == 6
    assert call["network"]["bytes"] == 11
    assert call["event"]["duration"] == 1_500_000  # 1.5 ms in ns
    assert call["error"] == {"type": "ClientError"}
    assert call["http"]["response"]["status_code"] == 403
    for gone in ("bytes_up", "bytes_down", "latency_ms", "status", "error"):
        assert gone not in call["stockade"]
    end = _event("sandbox_lifecycle", None)
    assert end["process"] == {"exit_code": 2} and end["event"]["duration"] == 3_500_000_000
    req = _event("request_decision", "allowed")
    assert req["http"]["version"] == "HTTP/1.1" and "http_version" not in req["stockade"]
    export = _event("export_decision", "denied")
    assert export["file"] == {"name": "out.txt", "size": 12}
    assert export["stockade"]["export"] == {"type": "text", "why": "too_big"}


def test_a_negative_exit_code_is_a_signal_and_moves():
    ev = make_event(component="stack", action="component_restarted", extra={"exit_code": -9})
    assert ev["process"] == {"exit_code": -9} and "exit_code" not in ev["stockade"]
    validate(ev)
    assert problems(ev, ECS) == []


def test_the_schema_uses_only_known_keywords():
    known = {"$schema", "$id", "title", "description", "type", "required", "properties",
             "additionalProperties", "items", "enum", "const", "pattern", "minimum", "maximum",
             "exclusiveMinimum", "x-es-type"}

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            assert set(node) <= known, f"{where}: {set(node) - known}"
            for k, sub in node.get("properties", {}).items():
                walk(sub, f"{where}.{k}")
            for k in ("items", "additionalProperties"):
                walk(node.get(k), f"{where}[{k}]")
    walk(schema(), "$")


def test_a_standard_key_of_the_wrong_type_stays_and_fails_the_schema(unchecked_events):
    ev = make_event(component="gateway", action="connection_close",
                    extra={"bytes_up": "lots", "duration_s": -1})
    assert ev["stockade"]["bytes_up"] == "lots" and ev["stockade"]["duration_s"] == -1
    assert "source" not in ev and "duration" not in ev["event"]
    with pytest.raises(jsonschema.ValidationError):
        validate(ev)


def test_a_status_other_than_the_http_status_is_kept(unchecked_events):
    ev = make_event(component="broker", action="broker_call", http_status=200,
                    extra={"status": 502})
    assert ev["stockade"]["status"] == 502
    with pytest.raises(jsonschema.ValidationError):
        validate(ev)


def test_the_caller_extra_is_not_changed():
    extra = {"bytes_up": 1, "bytes_down": 2, "export": {"name": "a", "size": 1, "type": "t"}}
    before = copy.deepcopy(extra)
    make_event(component="launcher", action="export_decision", extra=extra)
    assert extra == before


def test_stockade_is_closed(unchecked_events):
    ev = make_event(component="gateway", action="connection_decision", extra={"surprise": 1})
    with pytest.raises(jsonschema.ValidationError, match="surprise"):
        validate(ev)


# --- schema.json against ECS ---------------------------------------------------------------

def test_every_schema_leaf_has_an_es_type_and_outside_stockade_it_is_ecs():
    leaves = dict(schema_leaves(schema()))
    assert leaves, "schema.json declares no leaves"
    for name, node in leaves.items():
        assert "x-es-type" in node, f"{name} has no x-es-type"
        if name.split(".", 1)[0] == CUSTOM:
            continue
        assert name in ECS["fields"], f"{name} is not an ECS {ECS['ecs_version']} field"
        assert node["x-es-type"] == ECS["fields"][name][0], name


def test_every_schema_object_is_closed():
    def walk(node: dict[str, Any], where: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{where} is open"
            for k, sub in node["properties"].items():
                walk(sub, f"{where}.{k}")
    walk(schema(), "$")


def test_the_vendored_definitions_are_the_ecs_version_events_name():
    assert ECS["ecs_version"] == ECS_VERSION
    assert ECS["required"] == ["@timestamp", "ecs.version"]


# --- ecs_check rejects what it should: one case per rule -----------------------------------

def _broken(change) -> list[str]:
    ev = _event("connection_decision", "denied")
    change(ev)
    return problems(ev, ECS)


@pytest.mark.parametrize(("change", "expect"), [
    (lambda ev: ev.pop("ecs"), "missing required ecs.version"),
    (lambda ev: ev.pop("@timestamp"), "missing required @timestamp"),
    (lambda ev: ev["source"].update(colour="red"), "source.colour: not an ECS 9.4.0 field"),
    (lambda ev: ev["source"].update(port="443"), "'443' is not ECS type long"),
    (lambda ev: ev["source"].update(ip="not-an-ip"), "'not-an-ip' is not ECS type ip"),
    (lambda ev: ev.update({"@timestamp": "yesterday"}), "is not ECS type date"),
    (lambda ev: ev["event"].update(action=["a"]), "event.action: ECS field is not an array"),
    (lambda ev: ev["event"].update(category="network"), "event.category: ECS expects an array"),
    (lambda ev: ev["labels"].update(n=1), "labels.n: labels.* must be strings"),
    (lambda ev: ev["event"].update(kind="notice"), "event.kind 'notice' not allowed"),
    (lambda ev: ev["event"].update(outcome="meh"), "event.outcome 'meh' not allowed"),
    (lambda ev: ev["event"].update(category=["spaceship"]), "event.category 'spaceship'"),
    (lambda ev: ev["event"].update(type=["launch"]), "event.type 'launch' not allowed"),
    # the strict pair rule: broker_call's 1.0 category/type
    (lambda ev: ev["event"].update(category=["network", "iam"], type=["denied"]),
     "event.type 'denied' not expected for event.category 'iam'"),
])
def test_each_rule_rejects_its_case(change, expect):
    found = _broken(change)
    assert any(expect in p for p in found), found


def test_stockade_fields_are_left_to_the_schema():
    assert _broken(lambda ev: ev["stockade"].update(anything={"x": 1})) == []


# --- the suite-wide check (tests/conftest.py) -----------------------------------------------

@pytest.mark.parametrize("module", [
    "stockade.events", "stockade.events.build", "stockade.events.summary",
    "stockade.events.writer", "stockade.gateway.conn_events", "stockade.gateway.dns.decide",
    "stockade.broker.audit", "stockade.launcher.lifecycle", "stockade.policy.holder",
    "stockade.stack.up"])
def test_the_suite_wide_check_sees_every_builder(module):
    bound = importlib.import_module(module).make_event
    assert bound is importlib.import_module("stockade.events.build").make_event
    assert getattr(bound, "__wrapped__", None) is not None, "make_event is not wrapped"


def test_the_suite_wide_check_reports_a_bad_event(unchecked_events):
    bad = make_event(component="gateway", action="connection_decision", decision="denied",
                     extra={"surprise": 1})
    saved = list(unchecked_events.failures)
    try:
        unchecked_events.check(bad)
        found = unchecked_events.failures[len(saved):]
    finally:
        unchecked_events.failures[:] = saved  # not a failure of this session
    assert len(found) == 1 and "'surprise' was unexpected" in found[0], found
