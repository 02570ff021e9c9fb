"""The fast event path (make_event without a cleanup pass, orjson lines) against the
implementation it replaced (tests/core/events_oracle.py, verbatim) upgraded to schema 2.0
by the documented changes (`upgrade_v2`): same fields, same key order, same lines."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, datetime
from typing import Any

from events_oracle import old_line, old_make_event, upgrade_v2
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade.events import EventWriter, make_event, read_events, schema, validate
from stockade.events.writer import encode_line

# --- strategies ---------------------------------------------------------------------------

ACTIONS = [*schema()["properties"]["event"]["properties"]["action"]["enum"], "something_new"]
opt_text = st.none() | st.text(max_size=12)
opt_port = st.none() | st.integers(0, 65535)
# ints past 64 bits exercise the stdlib fallback (orjson refuses them)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False)
)
keys = st.text(max_size=6) | st.sampled_from(
    ["decision", "component", "schema_version", "report_only", "api", "bytes_up"]
)
nested = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)
opt_dict = st.none() | st.dictionaries(keys, nested, max_size=4)

event_kwargs = st.fixed_dictionaries(
    {
        "component": st.sampled_from(["gateway", "dns", "broker", "launcher", "rules"]),
        "action": st.sampled_from(ACTIONS),
    },
    optional={
        "decision": st.sampled_from([None, "allowed", "denied"]),
        "reason": opt_text,
        "task_id": opt_text,
        "profile": opt_text,
        "policy_version": opt_text,
        "rule_id": opt_text,
        "report_only": st.booleans(),
        "source_ip": opt_text,
        "source_port": opt_port,
        "destination_domain": opt_text,
        "destination_ip": opt_text,
        "destination_port": opt_port,
        "transport": st.sampled_from([None, "tcp", "udp"]),
        "protocol": opt_text,
        "http_method": opt_text,
        "url": opt_dict,
        "http_status": st.none() | st.integers(100, 599),
        "dns_question": opt_dict,
        "dns_response_code": opt_text,
        "message": opt_text,
        "extra": opt_dict,
        "now": st.floats(0, 4e9),
    },
)


def _ordered(line: bytes) -> Any:
    """The parsed line with key order kept (pairs lists), floats as values: the float
    spelling may differ (orjson writes 1e-05 as 0.00001), the number may not."""
    return json.loads(line, object_pairs_hook=list)


def _has_float(x: Any) -> bool:
    if isinstance(x, float):
        return True
    if isinstance(x, dict):
        return any(_has_float(v) for v in x.values())
    if isinstance(x, list):
        return any(_has_float(v) for v in x)
    return False


@settings(max_examples=400, deadline=None)
@given(event_kwargs)
def test_new_event_and_line_equal_the_old(kw):
    kw.setdefault("now", 1_790_000_000.5)
    new, old = make_event(**kw), upgrade_v2(old_make_event(**kw), kw)
    assert new == old
    # same key order at every level (dict equality ignores order)
    assert json.dumps(new, default=str) == json.dumps(old, default=str)
    a, b = encode_line(new), old_line(old)
    assert a.endswith(b"\n") and a.count(b"\n") == 1
    if _has_float(old.get("stockade")) or _has_float(old.get("url")) or _has_float(
        old.get("dns")
    ):
        assert _ordered(a) == _ordered(b)
    else:
        assert a == b


@given(event_kwargs)
@settings(max_examples=50, deadline=None)
def test_new_event_does_not_share_callers_dicts(kw):
    ev = make_event(**kw)
    for name, path in (("url", ("url",)), ("dns_question", ("dns", "question"))):
        got: Any = ev
        for p in path:
            got = got.get(p) if isinstance(got, dict) else None
        if kw.get(name) is not None and got is not None:
            assert got is not kw[name]


def test_hot_shapes_are_byte_identical_and_valid(tmp_path):
    now = 1_790_000_000.25
    shapes = [
        dict(component="gateway", action="connection_decision", decision="allowed",
             reason="allowed_by_rule", task_id="t", profile="p", policy_version="v1",
             rule_id="r", source_ip="10.0.0.2", source_port=4000, destination_domain="x.test",
             destination_ip="192.0.2.1", destination_port=443, transport="tcp",
             protocol="tls", message=None,
             extra={"listener": "transparent", "connection_id": 7,
                    "original_destination": "192.0.2.1:443"}, now=now),
        dict(component="gateway", action="connection_close", decision=None, reason="closed",
             task_id="t", source_ip="10.0.0.2", source_port=4000, destination_port=443,
             transport="tcp", extra={"bytes_up": 1, "bytes_down": 2, "duration_s": 0.25,
                                     "connection_id": 7}, now=now),
        dict(component="broker", action="broker_call", decision="denied", reason="no_rule",
             task_id="t", http_method="POST", http_status=403, url={"path": "/v1/ü"},
             extra={"api": "demo", "status": 403, "latency_ms": 1.5}, now=now),
        dict(component="dns", action="dns_decision", decision="denied", reason="qtype",
             dns_question={"name": "x.test", "type": "TXT"}, dns_response_code="REFUSED",
             report_only=True, now=now),
    ]
    w = EventWriter(tmp_path / "e.jsonl")
    for kw in shapes:
        ev = make_event(**kw)
        validate(ev)
        assert encode_line(ev) == old_line(upgrade_v2(old_make_event(**kw), kw))
        assert w.write(ev)
    w.close()
    want = [upgrade_v2(old_make_event(**kw), kw) for kw in shapes]
    assert (tmp_path / "e.jsonl").read_bytes() == b"".join(old_line(ev) for ev in want)
    assert read_events(tmp_path / "e.jsonl") == want


def test_lines_orjson_refuses_keep_the_old_form():
    for ev in ({1: "a", None: "b", 1.5: "c"}, {"big": 2**80, "neg": -(2**70)}):
        assert encode_line(ev) == old_line(ev)


@dataclasses.dataclass
class _Thing:
    x: int = 1


def test_unserialisable_events_are_counted_not_raised(tmp_path):
    w = EventWriter(tmp_path / "e.jsonl")
    # refused by json.dumps before, so still refused (orjson would write these itself)
    assert w.write({"a": _Thing()}) is False
    assert w.write({"a": datetime.now(UTC)}) is False
    assert w.write({"a": object()}) is False
    # a lone surrogate cannot be UTF-8: counted (it used to raise out of write())
    assert w.write({"a": "\ud800"}) is False
    assert w.dropped == 4 and w.written == 0
    assert w.write({"a": str(uuid.UUID(int=1))}) is True
    w.close()


def test_stdout_line_is_the_file_line(tmp_path, capsys):
    ev = make_event(component="gateway", action="connection_decision", decision="denied",
                    reason="r", message="naïve → ok", now=1_790_000_000.0)
    w = EventWriter(tmp_path / "e.jsonl", stdout=True)
    assert w.write(ev)
    w.close()
    out = capsys.readouterr().out
    assert out.encode("utf-8") == (tmp_path / "e.jsonl").read_bytes() == old_line(ev)
