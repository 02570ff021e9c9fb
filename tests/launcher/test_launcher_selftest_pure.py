"""The fence self-test's pure part (launcher/selftest.py): the plan, the verdict over
outcomes and events, the sampling, and which events are the probes'."""

from __future__ import annotations

import random

from stockade.launcher.selftest import (
    MARKER_ZONE,
    Observation,
    ServicePorts,
    is_probe_event,
    judge,
    pending_evidence,
    plan,
    should_run,
    without_probe_events,
)
from stockade.launcher.settings import SelftestSettings
from stockade.policy.model import EgressEntry, HttpRule, Profile

from stockade.events import make_event

PORTS = ServicePorts(broker=8090, control=(9464, 9465))
SETTINGS = SelftestSettings(raw_ip="198.51.100.7", outside_resolver="198.51.100.53")


def _profile(**kw: object) -> Profile:
    return Profile("p", "selftest", **kw)  # type: ignore[arg-type]


def test_the_plan_probes_every_path_out_and_one_allowed_name() -> None:
    allow = (EgressEntry("a", "r", host="*.wild.test"),
             EgressEntry("b", "r", host="inspected.test", http=HttpRule(frozenset({"GET"}), ())),
             EgressEntry("c", "r", host="pypi.test"))
    probes = {p.name: p for p in plan(_profile(allow=allow), "t1", "10.0.0.1", PORTS, SETTINGS)}
    assert set(probes) == {"dns_denied_name", "tls_denied_name", "outside_resolver", "raw_ip",
                           "udp", "host_service", "exempt_port_elsewhere", "ipv6",
                           "control_tcp_9464", "control_tcp_9465", "allowed_name"}
    assert probes["allowed_name"].qname == "pypi.test"  # no wildcard, not inspected
    assert probes["tls_denied_name"].qname == f"tls.t1.{MARKER_ZONE}"
    assert (probes["raw_ip"].host, probes["outside_resolver"].host) == (
        "198.51.100.7", "198.51.100.53")
    assert probes["exempt_port_elsewhere"].port == 8090
    assert probes["host_service"].host == "10.0.0.1"
    assert probes["ipv6"].evidence is None  # nothing leaves the namespace to be logged


def test_a_report_only_profile_is_probed_below_the_names() -> None:
    names = {p.name for p in plan(_profile(mode="report"), "t", "10.0.0.1", PORTS, SETTINGS)}
    assert not names & {"dns_denied_name", "tls_denied_name", "outside_resolver"}
    assert "allowed_name" not in names and "raw_ip" in names


def _denied(component: str, action: str, reason: str, **kw: object) -> dict:
    return make_event(component=component, action=action, decision="denied",  # type: ignore[arg-type]
                      reason=reason, task_id="t", **kw)  # type: ignore[arg-type]


def test_a_probe_needs_its_outcome_and_its_event() -> None:
    probes = [p for p in plan(_profile(), "t", "10.0.0.1", ServicePorts(8090), SETTINGS)
              if p.name in ("tls_denied_name", "dns_denied_name", "ipv6", "udp")]
    seen = {"tls_denied_name": Observation("tls_denied_name", "closed", 40001),
            "dns_denied_name": Observation("dns_denied_name", "answer:REFUSED", 40002),
            "ipv6": Observation("ipv6", "unreachable"),
            "udp": Observation("udp", "reply", 40003, "a UDP answer came back")}
    events = [_denied("gateway", "connection_decision", "no_matching_rule", source_port=40001),
              # the right port, the wrong reason: not the evidence
              _denied("dns", "dns_decision", "qtype_refused", source_port=40002)]
    assert pending_evidence(probes, seen, events)
    res = {r.probe: r for r in judge(probes, seen, events)}
    assert res["tls_denied_name"].passed and res["tls_denied_name"].evidence is True
    assert res["ipv6"].passed and res["ipv6"].evidence is None
    assert not res["dns_denied_name"].passed and res["dns_denied_name"].evidence is False
    assert "no dns dns_decision event" in res["dns_denied_name"].why
    assert not res["udp"].passed and "saw reply" in res["udp"].why
    # the DNS firewall's denial, found by the marker name
    events.append(_denied("dns", "dns_decision", "no_matching_rule",
                          dns_question={"name": f"dns.t.{MARKER_ZONE}.", "type": "A"}))
    assert {r.probe for r in judge(probes, seen, events) if r.passed} == {
        "tls_denied_name", "ipv6", "dns_denied_name"}


def test_a_probe_that_never_ran_fails() -> None:
    probes = plan(_profile(), "t", "10.0.0.1", PORTS, SETTINGS)
    assert not any(r.passed for r in judge(probes, {}, []))


def test_sampling_applies_to_sampled_profiles_only() -> None:
    rng = random.Random(7)
    assert should_run("required", 0.0, rng)
    assert not any(should_run("sampled", 0.0, rng) for _ in range(100))
    runs = sum(should_run("sampled", 0.25, rng) for _ in range(4000))
    assert 800 < runs < 1200


def test_the_probes_events_are_left_out_of_the_task_s_own() -> None:
    probe = _denied("gateway", "connection_decision", "sni_missing", source_port=40001,
                    now=100.0)
    marker = _denied("dns", "dns_decision", "no_matching_rule", now=100.1,
                     dns_question={"name": f"dns.t.{MARKER_ZONE}", "type": "A"})
    until = probe["@timestamp"].replace("00.000000", "00.500000")
    start = make_event(component="launcher", action="sandbox_lifecycle", task_id="t", now=101.0,
                       extra={"lifecycle": "start", "selftest": {"until": until}})
    # the command's, later, from a port a probe had used
    later = _denied("gateway", "connection_decision", "no_matching_rule", source_port=40001,
                    now=102.0)
    assert is_probe_event(probe, until) and is_probe_event(marker, "")
    assert not is_probe_event(later, until) and not is_probe_event(start, until)
    assert without_probe_events([probe, marker, start, later]) == [start, later]
    assert without_probe_events([later]) == [later]  # no self-test: nothing is the probes'


def test_a_probe_s_event_is_found_by_destination_when_nat_moved_its_port() -> None:
    probes = [p for p in plan(_profile(), "t", "10.0.0.1", PORTS, SETTINGS)
              if p.name in ("raw_ip", "tls_denied_name", "control_tcp_9464")]
    seen = {"raw_ip": Observation("raw_ip", "closed", 40001),
            "tls_denied_name": Observation("tls_denied_name", "closed", 40002),
            "control_tcp_9464": Observation("control_tcp_9464", "denied:no_matching_rule",
                                            40003)}
    events = [  # the ports the gateway saw are not the ones the probes bound
        _denied("gateway", "connection_decision", "no_matching_rule", source_port=50002,
                destination_domain=f"tls.t.{MARKER_ZONE}", destination_port=443),
        _denied("gateway", "connection_decision", "no_matching_rule", source_port=50003,
                destination_domain="10.0.0.1", destination_port=9464)]
    res = {r.probe: r.passed for r in judge(probes, seen, events)}
    # the SNI probe's event is not taken for the nameless one's
    assert res == {"raw_ip": False, "tls_denied_name": True, "control_tcp_9464": True}
    events.append(_denied("gateway", "connection_decision", "sni_missing", source_port=50001,
                          destination_port=443))
    assert all(r.passed for r in judge(probes, seen, events))


def test_a_profile_without_the_setting_is_required() -> None:
    assert _profile().selftest == "required"


def test_the_nft_counter_stands_for_the_bypass_event_only() -> None:
    probes = [p for p in plan(_profile(), "t", "10.0.0.1", PORTS, SETTINGS)
              if p.name in ("udp", "raw_ip")]
    seen = {"udp": Observation("udp", "timeout", 40001),
            "raw_ip": Observation("raw_ip", "closed", 40002)}
    assert {r.probe: r.passed for r in judge(probes, seen, [], counted=True)} == {
        "udp": True, "raw_ip": False}
    assert pending_evidence(probes, seen, [], counted=True)
