"""Events as the components build them, for the tests of what reads, writes and ships
events (tests/core/test_events.py, tests/deploy/test_deploy_logging.py,
tests/stack/test_demo_eval.py): one builder per kind, its constant fields filled in."""

from __future__ import annotations

from typing import Any

from stockade.events import make_event

# a gateway's denial of a TLS connection, as the event tests' baseline
DENIAL = {"decision": "denied", "reason": "no_matching_rule", "task_id": "t-1",
          "profile": "pypi-build", "policy_version": "abc123", "source_ip": "10.213.0.2",
          "destination_domain": "evil.test", "destination_port": 443, "transport": "tcp",
          "protocol": "tls"}


def denial(**kw: Any) -> dict[str, Any]:
    """A gateway connection_decision: DENIAL with `kw` on top."""
    return connection_decision(**{**DENIAL, **kw})


def connection_decision(**kw: Any) -> dict[str, Any]:
    return make_event(component="gateway", action="connection_decision", **kw)


def dns_decision(name: str, qtype: str, **kw: Any) -> dict[str, Any]:
    """A DNS firewall's decision on the question `name` `qtype`."""
    return make_event(component="dns", action="dns_decision",
                      dns_question={"name": name, "type": qtype}, **kw)


def bypass_attempt(**kw: Any) -> dict[str, Any]:
    """The launcher's alert for a packet that went around the gateway (always denied)."""
    return make_event(component="launcher", action="bypass_attempt", decision="denied", **kw)


def broker_call(**kw: Any) -> dict[str, Any]:
    return make_event(component="broker", action="broker_call", **kw)
