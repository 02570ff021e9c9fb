"""Verdicts turn into schema-valid events (allow, deny, report-only)."""

from __future__ import annotations

from stockade.policy import RequestFacts, decide, decide_name
from stockade.policy.eventfields import verdict_fields

from stockade.events import make_event, validate

PROFILE = """
profile: p
egress:
  mode: {mode}
  allow: [{{host: a.test, reason: r}}]
  deny: [{{host: b.test, reason: r}}]
"""


def test_verdict_events_validate(load_profile):
    for mode in ("enforce", "report"):
        rs = load_profile(PROFILE.format(mode=mode))
        for host in ("a.test", "b.test", "c.test", "a@b"):
            v = decide(rs, "p", RequestFacts(host=host))
            ev = make_event(component="gateway", action="connection_decision", task_id="t1",
                            profile="p", destination_domain=host, destination_port=443,
                            **verdict_fields(v))  # fmt: skip
            validate(ev)
            assert ev["rule"]["ruleset"] == rs.version
            assert ev["event"]["reason"] == v.reason
            assert ev["stockade"]["decision"] == ("allowed" if v.allowed else "denied")
            if v.report_only:
                assert ev["stockade"]["report_only"] is True and mode == "report"
            if host == "a@b":
                assert ev["stockade"]["decision"] == "denied"
        d = decide_name(rs, "p", "b.test")
        question = {"name": "b.test", "type": "A"}
        ev = make_event(
            component="dns", action="dns_decision", dns_question=question, **verdict_fields(d)
        )
        validate(ev)
        assert ev["rule"]["id"] == "p:deny:b.test"
