"""The demo's verdict logic (pure): a step passes only when observed as expected AND,
for blocked steps, reported by a denial event; the key must appear nowhere."""

import base64
import json

from sample_events import bypass_attempt, connection_decision, dns_decision

from stockade.stack.demo import STEPS, evaluate, parse_observations, render

SECRET = "demo-key-0123456789abcdef"
SUBST = {"denied_ip": "10.250.0.11", "udp_ip": "10.250.0.20"}


def _good_stdout(extra_env=None):
    env = {"PATH": "/usr/bin", **(extra_env or {})}
    lines = [
        {"step": "pip_install", "observed": "installed"},
        {"step": "exfil_https", "observed": "blocked"},
        {"step": "exfil_ip_literal", "observed": "blocked"},
        {"step": "exfil_dns_tunnel", "observed": "blocked"},
        {"step": "exfil_udp", "observed": "blocked"},
        {"step": "broker_call", "observed": "ok"},
        {"step": "key_in_env", "observed": "printed", "detail": env},
        {"step": "key_in_files", "observed": "printed", "detail": []},
        {"step": "key_via_echo", "observed": "printed", "detail": {"Authorization": "[REDACTED]"}},
        {"step": "api_direct", "observed": "blocked"},
    ]
    return "pip noise\n" + "\n".join(json.dumps(x) for x in lines) + "\n"


def _denials():
    def gw(**kw):
        return connection_decision(decision="denied", task_id="t", reason="no_matching_rule",
                                   **kw)

    return [
        gw(destination_domain="denied.test", destination_port=443),
        gw(destination_ip="10.250.0.11", destination_port=80),
        dns_decision("6375.tunnel.test", "A", decision="denied", task_id="t"),
        bypass_attempt(task_id="t", destination_ip="10.250.0.20", transport="udp"),
        dns_decision("api.test", "A", decision="denied", task_id="t"),
    ]


def test_all_expected_passes():
    out = _good_stdout()
    rows = evaluate(parse_observations(out), _denials(), SECRET, out, SUBST)
    assert [r["step"] for r in rows] == [s.key for s in STEPS] + ["no_leak"]
    assert all(r["ok"] for r in rows), rows
    assert "ok" in render(rows, colour=False)


def test_blocked_but_not_reported_fails():
    out = _good_stdout()
    denials = [d for d in _denials() if d["stockade"]["component"] != "launcher"]
    rows = {r["step"]: r for r in evaluate(parse_observations(out), denials, SECRET, out, SUBST)}
    assert rows["exfil_udp"]["ok"] is False
    assert rows["exfil_udp"]["reported"] == "NO"


def test_key_in_env_in_any_form_fails():
    for form in (SECRET, base64.b64encode(SECRET.encode()).decode(), SECRET.encode().hex()):
        out = _good_stdout({"LEAK": form})
        rows = {
            r["step"]: r for r in evaluate(parse_observations(out), _denials(), SECRET, out, SUBST)
        }
        assert rows["key_in_env"]["observed"] == "FOUND"
        assert rows["no_leak"]["ok"] is False


def test_missing_or_wrong_observation_fails():
    out = _good_stdout().replace(
        '"exfil_https", "observed": "blocked"', '"exfil_https", "observed": "reached"'
    )
    out = "\n".join(x for x in out.splitlines() if "broker_call" not in x)
    rows = {r["step"]: r for r in evaluate(parse_observations(out), _denials(), SECRET, out, SUBST)}
    assert rows["exfil_https"]["ok"] is False
    assert rows["broker_call"]["observed"] == "no report"
    assert rows["broker_call"]["ok"] is False
