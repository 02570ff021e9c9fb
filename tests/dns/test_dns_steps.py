"""Table tests for the named steps of the DNS decision core and the fast query parser
(`precheck`, `conclude` and `parse_query_fast` are covered end to end in test_dns_core)."""

from __future__ import annotations

import struct

import pytest
from dnslib import RCODE
from stockade.gateway.dns.decide import (
    RCODE_BADVERS,
    NeedResolve,
    _address_outcome,
    _cname_chain,
    _cname_policy,
    _common,
    _error_outcome,
    _header_refusal,
    _rate_refusal,
    _shape_refusal,
    _type_outcome,
)
from stockade.gateway.dns.guards import GuardState
from stockade.gateway.dns.packet import Query, Record, _fast_opt, _fast_qname
from stockade.gateway.dns.settings import DnsSettings
from stockade.policy import Reason, Verdict
from stockade.policy.ruleset import RuleSet

from stockade.net.resolver import Resolution
from stockade.tasks.registry import Task

S = DnsSettings()
TASK = Task("t1", "10.9.0.2", "dns-test")
ALLOWED = Verdict(True, Reason.ALLOWED_BY_RULE, "v1", rule_id="r1")
COMMON = _common("allowed.test", "r1", True, "v1")


def query(**kw: object) -> Query:
    fields: dict[str, object] = {
        "id": 1,
        "labels": (b"allowed", b"test"),
        "qtype": 1,
        "qclass": 1,
        "rd": True,
        "opcode": 0,
        "qdcount": 1,
        "edns": False,
    }
    return Query(**{**fields, **kw})  # type: ignore[arg-type]


def resolution(**kw: object) -> Resolution:
    fields: dict[str, object] = {
        "name": "allowed.test",
        "cnames": (),
        "addresses": (),
        "forbidden": (),
        "ttl": 60,
        "error": None,
    }
    return Resolution(**{**fields, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({}, None),
        ({"opcode": 2}, (RCODE.NOTIMP, "opcode")),
        ({"qdcount": 2}, (RCODE.FORMERR, "qdcount != 1")),
        ({"edns": True, "edns_version": 1}, (RCODE_BADVERS, "EDNS version")),
        ({"edns": False, "edns_version": 1}, None),
        ({"opcode": 2, "qdcount": 2}, (RCODE.NOTIMP, "opcode")),  # the opcode comes first
    ],
)
def test_header_refusal(kw: dict[str, object], want: tuple[int, str] | None) -> None:
    out = _header_refusal(query(**kw))
    if want is None:
        assert out is None
        return
    assert out is not None and out.reply is not None
    assert (out.reason, out.reply.rcode, out.message) == (Reason.MALFORMED_QUERY, *want)


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({}, None),
        ({"qclass": 3}, Reason.QTYPE_REFUSED),
        ({"labels": (b"x" * (S.max_label_length + 1), b"test")}, Reason.LABEL_TOO_LONG),
        ({"labels": (b"x" * 50,) * 6}, Reason.NAME_TOO_LONG),
        ({"qclass": 3, "labels": (b"x" * 50,) * 6}, Reason.QTYPE_REFUSED),
    ],
)
def test_shape_refusal(kw: dict[str, object], want: Reason | None) -> None:
    out = _shape_refusal(query(**kw), S, "v1")
    assert (out.reason if out else None) == want
    assert out is None or out.policy_version == "v1"


def test_rate_refusal_logs_the_first_refusal_only() -> None:
    guards = GuardState(1.0, 1, S.unresolvable_names_per_minute)
    assert _rate_refusal(S, guards, TASK, "v1", 1.0) is None
    first = _rate_refusal(S, guards, TASK, "v1", 1.0)
    again = _rate_refusal(S, guards, TASK, "v1", 1.0)
    assert first is not None and again is not None
    assert first.reason == again.reason == Reason.QUERY_RATE_EXCEEDED
    assert first.log and not again.log


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({"qtype": 1}, None),
        ({"qtype": 28}, None),
        ({"qtype": 5}, None),
        ({"qtype": 16}, ("denied", Reason.QTYPE_REFUSED)),
        ({"qtype": 65}, ("allowed", Reason.ALLOWED_BY_RULE)),
        ({"qtype": 64}, ("allowed", Reason.ALLOWED_BY_RULE)),
        ({"labels": (b"q8z3k1v7m2p9w4r6t0y5", b"test")}, ("denied", Reason.HIGH_ENTROPY_LABEL)),
    ],
)
def test_type_outcome(kw: dict[str, object], want: tuple[str, Reason] | None) -> None:
    out = _type_outcome(query(**kw), S, ALLOWED, COMMON)
    assert (None if out is None else (out.decision, out.reason)) == want
    if out is not None:  # refusals guard the channel: never report-only
        assert out.report_only == (out.decision == "allowed")


@pytest.mark.parametrize(
    ("error", "want"),
    [
        (None, None),
        ("nxdomain", ("allowed", RCODE.NXDOMAIN)),
        ("timeout", ("denied", RCODE.SERVFAIL)),
        ("servfail", ("denied", RCODE.SERVFAIL)),
    ],
)
def test_error_outcome(error: str | None, want: tuple[str, int] | None) -> None:
    out = _error_outcome(resolution(error=error), ALLOWED.reason, COMMON)
    assert (None if out is None else (out.decision, out.reply and out.reply.rcode)) == want
    if out is not None and out.decision == "denied":
        assert out.extra == {"resolve_error": error} and not out.report_only


def test_cname_chain() -> None:
    assert _cname_chain((), 30) == ([], None)
    records, owner = _cname_chain(("a.test", "b.test"), 30)
    assert records == [Record(None, "CNAME", 30, "a.test"), Record("a.test", "CNAME", 30, "b.test")]
    assert owner == "b.test"


@pytest.mark.parametrize(
    ("qtype", "addresses", "forbidden", "answers", "extra"),
    [
        (1, ("192.0.2.1", "2001:db8::1"), (), ("192.0.2.1",), {}),
        (28, ("192.0.2.1", "2001:db8::1"), (), ("2001:db8::1",), {}),
        (
            1,
            ("192.0.2.1",),
            (("10.0.0.1", "private"),),
            ("192.0.2.1",),
            {"forbidden_addresses": ["10.0.0.1 private"]},
        ),
        (1, (), (("10.0.0.1", "private"),), None, {"forbidden_addresses": ["10.0.0.1 private"]}),
        (28, ("192.0.2.1",), (("10.0.0.1", "private"),), (), {}),
    ],
)
def test_address_outcome(
    qtype: int,
    addresses: tuple[str, ...],
    forbidden: tuple[tuple[str, str], ...],
    answers: tuple[str, ...] | None,
    extra: dict[str, object],
) -> None:
    res = resolution(addresses=addresses, forbidden=forbidden)
    out = _address_outcome(query(qtype=qtype), res, ALLOWED.reason, ([], None), 30, S, COMMON)
    assert out.extra == extra
    if answers is None:
        assert (out.decision, out.reason) == ("denied", Reason.ADDRESS_FORBIDDEN)
        assert out.message == "every address of the name is forbidden: private"
        return
    assert out.decision == "allowed" and out.reply is not None
    assert tuple(r.value for r in out.reply.answers) == answers


def test_cname_policy(ruleset: RuleSet) -> None:
    need = NeedResolve("www.allowed.test", ALLOWED)
    assert _cname_policy(ruleset, TASK, need, (), S, None) == (None, False)
    assert _cname_policy(ruleset, TASK, need, ("allowed.test",), S, None) == (None, False)
    denied, _ = _cname_policy(ruleset, TASK, need, ("allowed.test", "other.test"), S, None)
    assert denied is not None and denied.extra == {"cname": "other.test"}
    assert denied.message == "CNAME target other.test is not allowed"


def _name(*labels: bytes) -> bytes:
    return b"".join(bytes([len(x)]) + x for x in labels) + b"\0"


@pytest.mark.parametrize(
    ("question", "want"),
    [
        (_name(b"allowed", b"test"), ([b"allowed", b"test"], 12 + 14)),
        (b"\0", ([], 13)),
        (b"\x07allowed", None),  # runs past the message
        (b"\xc0\x0c", None),  # a compression pointer: the dnslib path
        (b"\x40" + b"x" * 64 + b"\0", None),  # a 64-byte label
    ],
)
def test_fast_qname(question: bytes, want: tuple[list[bytes], int] | None) -> None:
    data = b"\0" * 12 + question
    assert _fast_qname(data, len(data)) == want


def _opt(owner: bytes, rtype: int, size: int, ttl: int, rdata: bytes) -> bytes:
    return owner + struct.pack("!HHIH", rtype, size, ttl, len(rdata)) + rdata


@pytest.mark.parametrize(
    ("tail", "want"),
    [
        (_opt(b"\0", 41, 1232, 0, b""), (1232, 0, False)),
        (_opt(b"\0", 41, 100, 0x8000, b""), (512, 0, True)),
        (_opt(b"\0", 41, 4096, 0x010000, b"\0\x0a\0\0"), (4096, 1, False)),
        (_opt(b"\0", 1, 1232, 0, b""), None),  # not an OPT record
        (_opt(b"\x01a\0", 41, 1232, 0, b""), None),  # not the root owner
        (_opt(b"\0", 41, 1232, 0, b"") + b"\0", None),  # does not end the message
        (b"\0\0\x29", None),  # truncated
    ],
)
def test_fast_opt(tail: bytes, want: tuple[int, int, bool] | None) -> None:
    data = b"\0" * 20 + tail
    assert _fast_opt(data, 20, len(data)) == want
