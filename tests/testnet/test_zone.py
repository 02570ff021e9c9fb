"""The fake DNS zone (pure): standard names, trap names, rebinding, CNAMEs, fuzzing."""

from __future__ import annotations

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade.testing.testnet.layout import plan
from stockade.testing.testnet.zone import Record, Zone, ZoneSpec, default_zone

LAYOUT = plan()


def ask(zone: Zone, name: str, qtype: str = "A") -> tuple[dns.message.Message, float]:
    wire, delay = zone.respond(dns.message.make_query(name, qtype).to_wire())
    assert wire is not None
    return dns.message.from_wire(wire), delay


def values(msg: dns.message.Message, qtype: str) -> list[str]:
    want = dns.rdatatype.from_text(qtype)
    return [rd.to_text() for rrset in msg.answer if rrset.rdtype == want for rd in rrset]


@pytest.fixture
def zone() -> Zone:
    return Zone(default_zone(LAYOUT))


@pytest.mark.parametrize("name", sorted(LAYOUT.addresses))
def test_every_site_name_answers_its_address(zone: Zone, name: str) -> None:
    msg, delay = ask(zone, name)
    assert msg.rcode() == dns.rcode.NOERROR
    assert msg.flags & dns.flags.AA
    assert values(msg, "A") == [LAYOUT.addresses[name]]
    assert msg.answer[0].ttl == 60
    assert delay == 0


@pytest.mark.parametrize(
    ("name", "qtype", "expected"),
    [
        ("private.test", "A", ["10.0.0.5"]),
        ("metadata.test", "A", ["169.254.169.254"]),
        ("loopback.test", "A", ["127.0.0.1"]),
        ("cgnat.test", "A", ["100.64.0.7"]),
        ("mapped.test", "AAAA", ["::ffff:10.250.0.10"]),
        ("nat64.test", "AAAA", ["64:ff9b::afa:a"]),
        ("mixed.test", "A", ["10.250.0.10", "10.0.0.5"]),
        ("ipv6.test", "AAAA", [LAYOUT.ipv6_address]),
        ("raw.test", "A", ["10.250.0.20"]),
    ],
)
def test_trap_names(zone: Zone, name: str, qtype: str, expected: list[str]) -> None:
    msg, _ = ask(zone, name, qtype)
    assert sorted(values(msg, qtype)) == sorted(expected)


def test_ipv6_name_has_no_a_record(zone: Zone) -> None:
    msg, _ = ask(zone, "ipv6.test", "A")
    assert msg.rcode() == dns.rcode.NOERROR
    assert msg.answer == []


def test_rebind_alternates_with_ttl_zero(zone: Zone) -> None:
    seen = []
    for _ in range(4):
        msg, _ = ask(zone, "rebind.test")
        assert msg.answer[0].ttl == 0
        seen.extend(values(msg, "A"))
    assert seen == ["10.250.0.10", "127.0.0.1", "10.250.0.10", "127.0.0.1"]


def test_rebind_aaaa_does_not_advance_the_alternation(zone: Zone) -> None:
    first, _ = ask(zone, "rebind.test")
    ask(zone, "rebind.test", "AAAA")
    second, _ = ask(zone, "rebind.test")
    assert values(first, "A") != values(second, "A")


def test_cname_chain_is_followed(zone: Zone) -> None:
    msg, _ = ask(zone, "cname.test")
    assert values(msg, "CNAME") == ["allowed.test."]
    assert values(msg, "A") == ["10.250.0.10"]
    bad, _ = ask(zone, "cname-bad.test")
    assert values(bad, "CNAME") == ["denied.test."]
    assert values(bad, "A") == ["10.250.0.11"]


def test_txt_record(zone: Zone) -> None:
    msg, _ = ask(zone, "txt.test", "TXT")
    assert values(msg, "TXT") == ['"stockade fake internet txt record"']


@pytest.mark.parametrize(
    "name",
    ["tunnel.test", "abc.tunnel.test", "aGVsbG8.x.tunnel.test", "nothing.test", "example.com"],
)
def test_unknown_and_tunnel_names_are_nxdomain(zone: Zone, name: str) -> None:
    msg, _ = ask(zone, name)
    assert msg.rcode() == dns.rcode.NXDOMAIN
    assert msg.answer == []


def test_slow_name_carries_its_delay(zone: Zone) -> None:
    msg, delay = ask(zone, "slow.test")
    assert values(msg, "A") == ["10.250.0.10"]
    assert delay == 5.0


def test_names_are_case_insensitive(zone: Zone) -> None:
    msg, _ = ask(zone, "AlLoWeD.TeSt")
    assert values(msg, "A") == ["10.250.0.10"]


def test_extra_records() -> None:
    spec = default_zone(
        LAYOUT, {"extra.test": [("A", "10.250.0.10"), Record("TXT", "hi", 5)]}
    )
    zone = Zone(spec)
    assert values(ask(zone, "extra.test")[0], "A") == ["10.250.0.10"]
    txt, _ = ask(zone, "extra.test", "TXT")
    assert txt.answer[0].ttl == 5


def test_invalid_extra_record_rejected() -> None:
    with pytest.raises(ValueError):
        Record("A", "not-an-ip")
    with pytest.raises(ValueError):
        Record("MX", "x")


def test_spec_json_round_trip() -> None:
    spec = default_zone(LAYOUT)
    again = ZoneSpec.from_json(spec.to_json())
    assert again == spec


def test_responses_are_not_sent_for_responses(zone: Zone) -> None:
    query = dns.message.make_query("allowed.test", "A")
    response = dns.message.make_response(query)
    assert zone.respond(response.to_wire()) == (None, 0.0)


@settings(max_examples=300)
@given(st.binary(max_size=600))
def test_garbage_never_raises(data: bytes) -> None:
    zone = Zone(default_zone(LAYOUT))
    reply, delay = zone.respond(data)
    assert reply is None or isinstance(reply, bytes | bytearray)
    assert delay >= 0


_label = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)


@given(st.lists(_label, min_size=1, max_size=4))
def test_names_outside_zone_are_nxdomain(labels: list[str]) -> None:
    name = ".".join(labels) + ".invalid"
    msg, _ = ask(Zone(default_zone(LAYOUT)), name)
    assert msg.rcode() == dns.rcode.NXDOMAIN


@pytest.mark.parametrize("name", ["x.wild.test", "0a1b2c3d4e5f.f00d.wild.test", "WWW.Wild.Test."])
def test_answer_all_zone_answers_every_name(zone: Zone, name: str) -> None:
    msg, _ = ask(zone, name)
    assert msg.rcode() == dns.rcode.NOERROR
    assert values(msg, "A") == [LAYOUT.addresses["allowed.test"]]
    assert msg.answer[0].name.to_text().rstrip(".").lower() == name.rstrip(".").lower()


def test_zone_reports_every_query_it_parses() -> None:
    seen: list[tuple[str, str]] = []
    zone = Zone(default_zone(LAYOUT), lambda name, qtype: seen.append((name, qtype)))
    ask(zone, "abc.wild.test")
    ask(zone, "Nothing.Test.", "AAAA")
    assert zone.respond(b"junk") == (None, 0.0)
    assert seen == [("abc.wild.test", "A"), ("nothing.test", "AAAA")]


def test_answer_all_survives_the_spec_round_trip() -> None:
    spec = default_zone(LAYOUT)
    assert ZoneSpec.from_json(spec.to_json()).answer_all == {
        "wild.test": "allowed.test",
        "pypi.test": "pypi.test",
        "git.test": "git.test",
    }
