"""OCSF output (stockade/events/ocsf.py): every action x decision maps to a valid OCSF
1.5.0 event (checked offline and strictly with ocsf-emitter), a writer set to
`format: ocsf` writes such lines, and `stockade events verify` checks their chain."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
import sample_events
from pydantic import ValidationError

from stockade.events import make_event
from stockade.events.ocsf import to_ocsf
from stockade.events.settings import EventSettings
from stockade.events.verify import main

emitter = pytest.importorskip("ocsf_emitter", reason="ocsf-emitter (dev extra) not installed")
m = emitter._models
CLS = {4001: m.NetworkActivity, 4002: m.HttpActivity, 4003: m.DnsActivity, 6003: m.ApiActivity,
       1007: m.ProcessActivity, 2004: m.DetectionFinding, 1001: m.FileActivity,
       6002: m.ApplicationLifecycle, 1008: m.EventLogActvity}  # sic: upstream spelling
# the security_control profile's attributes, which ocsf-emitter's models do not declare
PROFILE = {"action", "action_id", "disposition", "disposition_id", "firewall_rule", "policy",
           "is_alert", "confidence_id", "risk_level_id", "risk_score"}


def _extras(o: Any, path: str = ""):
    """Undeclared keys: the models are extra="allow", so an unknown key would pass."""
    if isinstance(o, m.BaseModel):
        yield from (f"{path}{k}" for k in (o.model_extra or {}) if path or k not in PROFILE)
        for k in type(o).model_fields:
            if k != "unmapped":  # unmapped is OCSF's free-form object
                yield from _extras(getattr(o, k), f"{path}{k}.")
    elif isinstance(o, list):
        for x in o:
            yield from _extras(x, path)


def check_ocsf(ev: dict) -> None:
    try:
        obj = emitter.validate(CLS[ev["class_uid"]].model_validate(ev))
    except ValidationError as e:  # the models' own types (a port "x")
        raise emitter.InvalidFindingError(str(e)) from e
    if bad := list(_extras(obj)):
        raise emitter.InvalidFindingError("undeclared OCSF attributes", field_errors=bad)


_EXTRA: dict[str, dict[str, Any]] = {
    "request_decision": {"http_method": "POST", "http_status": 403,
                         "url": {"full": "https://evil.test/x?y=1", "domain": "evil.test",
                                 "path": "/x", "scheme": "https"}},
    "dns_decision": {"dns_question": {"name": "evil.test", "type": "A"},
                     "dns_response_code": "NXDOMAIN"},
    "broker_call": {"http_method": "GET", "http_status": 200,
                    "extra": {"api": "github", "latency_ms": 12.5}},
    "connection_close": {"reason": "upload_limit", "extra": {"bytes_up": 10, "bytes_down": 20}},
    "sandbox_lifecycle": {"task_id": "t-1", "extra": {"lifecycle": "start", "exit_code": 0}},
    "export_decision": {"extra": {"export": {"name": "out.tar", "size": 12, "type": "tar"}}},
    "vault_status": {"reason": "vault_up"},
    "event_summary": {"extra": {"summary": {"action": "connection_decision", "count": 7,
                                            "first": "2026-12-01T20:00:00.000000Z",
                                            "last": "2026-12-01T20:01:00.000000Z",
                                            "window_s": 60.0, "budget_exhausted": False}}},
}
ACTIONS = ["connection_decision", "connection_close", "request_decision", "dns_decision",
           "broker_call", "secret_echo", "bypass_attempt", "sandbox_lifecycle",
           "export_decision", "rules_reload", "vault_status", "component_restarted",
           "event_summary", "event_totals", "events_lost", "chain_checkpoint"]


def _samples() -> list[dict]:
    out = [sample_events.denial(source_port=40000, destination_ip="1.2.3.4"),
           sample_events.dns_decision("a.test", "AAAA", decision="allowed"),
           sample_events.bypass_attempt(source_ip="10.0.0.2", destination_ip="1.2.3.4",
                                        destination_port=53, transport="udp"),
           sample_events.broker_call(decision="denied", http_method="DELETE")]
    for action in ACTIONS:
        for decision in ("allowed", "denied", None):
            out.append(make_event(component="gateway", action=action, decision=decision,
                                  source_ip="10.213.0.2", destination_domain="h.test",
                                  destination_port=443, transport="tcp",
                                  message=f"{action} sample", **_EXTRA.get(action, {})))
    return out


@pytest.mark.parametrize("ev", _samples(), ids=lambda e: f"{e['event']['action']}-"
                         f"{e['stockade'].get('decision')}")
def test_every_sample_is_valid_ocsf(ev):
    before = json.dumps(ev, sort_keys=True)
    out = to_ocsf(ev)
    check_ocsf(out)
    assert json.dumps(ev, sort_keys=True) == before  # the event is not changed
    assert out["metadata"]["version"] == "1.5.0"
    assert out["type_uid"] == out["class_uid"] * 100 + out["activity_id"]
    assert out["metadata"]["event_code"] == ev["event"]["action"]
    rest = {k: v for k, v in ev["stockade"].items() if k != "chain"}
    assert out["unmapped"]["stockade"] == rest  # nothing of stockade.* is lost


@pytest.mark.parametrize(("action", "kw", "cls", "act"), [
    ("connection_decision", {"decision": "allowed"}, 4001, 1),
    ("connection_decision", {"decision": "denied"}, 4001, 5),
    ("connection_close", {"reason": "idle"}, 4001, 2),
    ("connection_close", {"reason": "task_ended"}, 4001, 3),
    ("request_decision", {"http_method": "PUT"}, 4002, 7),
    ("request_decision", {"http_method": "PROPFIND"}, 4002, 99),
    ("broker_call", {"http_method": "PATCH"}, 6003, 3),
    ("sandbox_lifecycle", {"extra": {"lifecycle": "end"}}, 1007, 2),
    ("sandbox_lifecycle", {"extra": {"lifecycle": "kill"}}, 1007, 99),
    ("rules_reload", {}, 6002, 8),
    ("component_restarted", {}, 6002, 5),
    ("events_lost", {}, 1008, 99),
])
def test_class_and_activity_per_action(action, kw, cls, act):
    out = to_ocsf(make_event(component="gateway", action=action, **kw))
    assert (out["class_uid"], out["activity_id"]) == (cls, act)


def test_fields_are_carried_over():
    ev = make_event(component="dns", action="dns_decision", decision="denied",
                    dns_question={"name": "x.test", "type": "TXT"}, dns_response_code="REFUSED",
                    now=1764615600.25)
    ev["event"] |= {"id": "abc-7", "sequence": 7}
    out = to_ocsf(ev)
    assert out["time"] == 1764615600250
    assert out["metadata"]["uid"] == "abc-7" and out["metadata"]["sequence"] == 7
    assert out["query"] == {"hostname": "x.test", "type": "TXT"}
    assert (out["rcode_id"], out["action_id"], out["disposition_id"]) == (5, 2, 2)
    assert out["severity_id"] == 1 and out["status_id"] == 2
    alert = to_ocsf(sample_events.bypass_attempt())
    assert alert["class_uid"] == 2004 and alert["severity_id"] == 3


def test_the_check_rejects_what_is_not_ocsf():
    good = to_ocsf(sample_events.denial())
    for bad in ({**good, "type_uid": good["type_uid"] + 1}, {**good, "bogus": 1},
                {**good, "src_endpoint": {"port": "x"}}):
        with pytest.raises(emitter.InvalidFindingError):
            check_ocsf(bad)


def test_an_ocsf_writer_writes_chained_ocsf_lines_that_verify(tmp_path: Path, capsys):
    settings = EventSettings(format="ocsf", chain_dir=str(tmp_path / "chain"),
                             checkpoint_every=10)
    w = settings.writer(tmp_path / "events.jsonl", None, False)
    for i in range(35):
        w.write(sample_events.denial(destination_domain=f"h{i}.test"))
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert len(lines) == 35 + 4  # the events and their checkpoints
    for ev in lines:
        check_ocsf(ev)
        assert "unmapped" in ev and "chain" in ev["unmapped"]
    assert [ev["metadata"]["sequence"] for ev in lines] == list(range(1, 40))
    argv = [str(tmp_path / "events.jsonl"), "--key", str(tmp_path / "chain" / "signing.pub"),
            "--heads", str(tmp_path / "chain" / "heads"), "--json"]
    assert main(argv) == 0, capsys.readouterr().out
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and next(iter(result["streams"].values()))["signed_seq"] == 38
    # an edit is caught in the OCSF shape too
    raw = (tmp_path / "events.jsonl").read_bytes().replace(b"h3.test", b"h9.test", 1)
    (tmp_path / "events.jsonl").write_bytes(raw)
    assert main(argv) == 1
    capsys.readouterr()


VECTOR_OCSF = Path(__file__).resolve().parents[2] / "deploy" / "logging" / "vector-ocsf.toml"


@pytest.fixture(scope="module")
def vrl_ocsf():
    """Runs deploy/logging/vector-ocsf.toml's remap on one event."""
    vrl = pytest.importorskip("vrl_python", reason="VRL bindings (pip: vrl-python) not installed")
    runtime = vrl.VRLRuntime()
    program = tomllib.loads(VECTOR_OCSF.read_text())["transforms"]["stockade_ocsf"]["source"]
    return lambda ev: runtime.execute(program, json.loads(json.dumps(ev))).processed_event


def _stamped() -> list[dict]:
    """The samples as written by a chain (id, sequence, link) and as shipped (host.name)."""
    out = []
    for i, ev in enumerate(_samples()):
        ev = json.loads(json.dumps(ev))
        ev["event"] |= {"id": f"s-{i + 1}", "sequence": i + 1}
        ev["stockade"]["chain"] = {"stream": "s", "prev": "0" * 64}
        ev["host"] = {"name": "gw1"}
        out.append(ev)
    return out


@pytest.mark.parametrize("ev", _samples() + _stamped(),
                         ids=lambda e: f"{e['event']['action']}-{e['stockade'].get('decision')}")
def test_the_vector_remap_gives_what_to_ocsf_gives(vrl_ocsf, ev):
    assert vrl_ocsf(ev) == to_ocsf(ev)


def test_the_vector_remap_on_odd_fields(vrl_ocsf):
    ev = make_event(component="gateway", action="request_decision", http_method="propfind",
                    extra={"duration_s": 1.9999})
    ev["@timestamp"] = "not a time"
    out = vrl_ocsf(ev)
    assert out == to_ocsf(ev)
    assert (out["activity_id"], out["time"], out["duration"]) == (99, 0, 1999)


def test_the_format_setting_picks_the_encoder_and_refuses_others():
    assert EventSettings().encoder() is None  # ECS: the writer's own encoder
    line = EventSettings(format="ocsf").encoder()(sample_events.denial())
    check_ocsf(json.loads(line))
    with pytest.raises(ValidationError, match="'ecs' or 'ocsf'"):
        EventSettings(format="xml")
