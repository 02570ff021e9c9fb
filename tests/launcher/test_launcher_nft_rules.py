"""The nft table builder (pure) and, with real nftables, atomic per-sandbox elements."""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.launcher import nft

P = nft.TableParams("stockade_unit", 15001, 15053, 8081, 7413, log_rate=20)


def _rules(cmds: dict) -> list[dict]:
    return [c["add"]["rule"] for c in cmds["nftables"] if "rule" in c.get("add", {})]


def test_every_log_is_rate_limited_and_in_the_group() -> None:
    rules = _rules(nft.table_commands(P))
    logs = [r for r in rules if any("log" in e for e in r["expr"])]
    assert len(logs) == 4
    for r in logs:
        kinds = [next(iter(e)) for e in r["expr"]]
        i = kinds.index("log")
        meter = r["expr"][i - 1]["set"]
        # rate-limited per interface: a meter keyed by iifname right before the log
        assert meter["op"] == "update" and meter["set"] == "@" + nft.SET_LOG_BUDGET
        assert meter["elem"] == {"meta": {"key": "iifname"}}
        assert meter["stmt"][0]["limit"]["rate"] == 20
        assert r["expr"][i]["log"]["group"] == 7413
        assert r["expr"][i]["log"]["prefix"].startswith("stockade:")


def test_chain_names_avoid_nft_keywords_and_only_own_table() -> None:
    cmds = nft.table_commands(P)["nftables"]
    chains = [c["add"]["chain"]["name"] for c in cmds if "chain" in c.get("add", {})]
    assert "fwd" not in chains and "dnat" not in chains
    for c in cmds:
        body = next(iter(c.values()))
        obj = next(iter(body.values()))
        assert obj.get("table", obj.get("name")) == "stockade_unit"


def test_redirects_and_reject_order() -> None:
    rules = _rules(nft.table_commands(P))
    red = [r for r in rules if r["chain"] == "redirect_in"]
    # broker exemption comes before the catch-all TCP redirect
    assert red[1]["expr"][-1] == {"accept": None}
    assert red[2]["expr"][-1] == {"redirect": {"port": 15053}}
    assert red[3]["expr"][-1] == {"redirect": {"port": 15001}}
    guard = [r for r in rules if r["chain"] == "from_sandbox"]
    assert guard[-2]["expr"][-1] == {"reject": {"type": "tcp reset"}}
    assert guard[-1]["expr"][-1] == {"reject": {"type": "icmpx", "expr": "admin-prohibited"}}


def test_rule_count_is_independent_of_sandboxes() -> None:
    w = [nft.Wiring(f"stk{i:010x}", f"10.0.{i // 64}.{(i % 64) * 4 + 2}", "02:00:00:00:00:01",
                    "10.0.0.1") for i in range(50)]
    add = nft.element_commands("t", "add", w)["nftables"]
    # one transaction: three elements per sandbox, no rules
    assert len(add) == 150
    assert all("element" in c["add"] for c in add)
    with pytest.raises(ValueError):
        nft.element_commands("t", "replace", w)


PP = nft.TableParams("stockade_unit", 15001, 15053, 8081, 7413, log_rate=20, proxy_port=3128)


def _proxy_rules(rules: list[dict]) -> list[dict]:
    return [r for r in rules if any(e.get("match", {}).get("right") == "@" + nft.SET_PROXY
                                    for e in r["expr"])]


def test_without_proxy_port_nothing_mentions_the_proxy() -> None:
    rules = _rules(nft.table_commands(P))
    assert _proxy_rules(rules) == []
    assert "3128" not in json.dumps(rules)
    # the same table as before the option existed: the catch-all TCP redirect follows the
    # broker exemption and the DNS redirect directly
    red = [r for r in rules if r["chain"] == "redirect_in"]
    assert len(red) == 4


def test_proxy_exemption_is_per_sandbox_like_the_broker_port() -> None:
    rules = _rules(nft.table_commands(PP))
    red = [r for r in rules if r["chain"] == "redirect_in"]
    guard = [r for r in rules if r["chain"] == "from_sandbox"]
    proxy = _proxy_rules(rules)
    assert [r["chain"] for r in proxy] == ["redirect_in", "from_sandbox"]
    for r in proxy:
        # (iifname, ip daddr) in the proxy set: a member's own host-side address only
        assert r["expr"][0]["match"]["left"] == {"concat": [
            {"meta": {"key": "iifname"}}, {"payload": {"protocol": "ip", "field": "daddr"}}]}
        assert r["expr"][1]["match"] == {"op": "==", "right": 3128, "left": {
            "payload": {"protocol": "tcp", "field": "dport"}}}
        assert r["expr"][-1] == {"accept": None}
    # accepted before the catch-all redirect, right after the broker exemption
    i = red.index(proxy[0])
    assert red[i - 1]["expr"][1]["match"]["right"] == 8081
    assert red[-1]["expr"][-1] == {"redirect": {"port": 15001}} and i < len(red) - 1
    # accepted by the guard before the log + reject; the common accept set is unchanged
    j = guard.index(proxy[1])
    assert any("log" in e for e in guard[j + 1]["expr"])
    common = [r for r in guard if any(e.get("match", {}).get("right") == "@" + nft.SET_HOST
                                      for e in r["expr"])]
    ports = [e["match"]["right"] for r in common for e in r["expr"][1:2]]
    assert ports == [{"set": [8081, 15001, 15053]}, 15053]


def test_proxy_elements_only_for_proxy_sandboxes_and_always_deleted() -> None:
    plain = nft.Wiring("stkaaaaaaaaaa", "10.213.0.2", "02:00:0a:d5:00:02", "10.213.0.1")
    prox = nft.Wiring("stkbbbbbbbbbb", "10.213.0.6", "02:00:0a:d5:00:06", "10.213.0.5",
                      proxy=True)
    add = nft.element_commands("t", "add", [plain, prox])["nftables"]
    in_proxy = [c["add"]["element"]["elem"] for c in add
                if c["add"]["element"]["name"] == nft.SET_PROXY]
    assert in_proxy == [[{"concat": ["stkbbbbbbbbbb", "10.213.0.5"]}]]
    # delete: add + delete of the proxy element, whatever the wiring says (idempotent in
    # one transaction, so teardown need not know the profile)
    for w in (plain, prox):
        cmds = nft.element_commands("t", "delete", [w])["nftables"]
        tail = [(next(iter(c)), next(iter(c.values()))["element"]["name"]) for c in cmds[-2:]]
        assert tail == [("add", nft.SET_PROXY), ("delete", nft.SET_PROXY)]
        assert len(cmds) == 7  # 3 sets + add/delete of the bypass counter and the proxy
        assert [c["add"]["element"]["name"] for c in cmds if "add" in c] == [
            nft.SET_BYPASS_COUNT, nft.SET_PROXY]
    assert nft.SET_PROXY in nft.PER_SANDBOX_SETS


@settings(deadline=None)
@given(st.text(min_size=1, max_size=15))
def test_element_ifname_roundtrip(name: str) -> None:
    assert nft.element_ifname(name) == name
    assert nft.element_ifname({"concat": [name, "10.0.0.2"]}) == name
    assert nft.element_ifname({"elem": {"val": {"concat": [name, "x"]}}}) == name
    assert nft.element_ifname(42) is None


@pytest.fixture
def table() -> Iterator[str]:
    name = f"stockade_lt{secrets.token_hex(4)}"
    yield name
    subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True, check=False)


@pytest.mark.netns
def test_real_table_elements_are_atomic(table: str) -> None:
    p = nft.TableParams(table, 15001, 15053, 8081, 7413)
    nft.apply_table(p)
    a = nft.Wiring("stkaaaaaaaaaa", "10.213.0.2", "02:00:0a:d5:00:02", "10.213.0.1")
    b = nft.Wiring("stkbbbbbbbbbb", "10.213.0.6", "02:00:0a:d5:00:06", "10.213.0.5")
    nft.run(nft.element_commands(table, "add", [a, b]))
    # re-applying the table (restart) keeps the sandboxes' elements
    nft.apply_table(p)
    els = nft.list_elements(table)
    assert sorted(els[nft.SET_IFS]) == ["stkaaaaaaaaaa", "stkbbbbbbbbbb"]
    # a batch with one bad element changes nothing (all or nothing)
    bad = nft.element_commands(table, "delete", [a, nft.Wiring("stkcccccccccc", "10.213.0.10",
                                                                "02:00:0a:d5:00:0a", "10.213.0.9")])
    with pytest.raises(nft.NftError):
        nft.run(bad)
    assert len(nft.list_elements(table)[nft.SET_SRC]) == 2
    nft.run(nft.element_commands(table, "delete", [a]))
    els = nft.list_elements(table)
    assert [nft.element_ifname(e) for e in els[nft.SET_SRC]] == ["stkbbbbbbbbbb"]
    out = subprocess.run(["nft", "-j", "list", "table", "inet", table], capture_output=True,
                         check=True)
    listed = json.loads(out.stdout)["nftables"]
    n_rules = sum(1 for i in listed if "rule" in i)
    assert sum(1 for i in listed if "set" in i) == 6  # + log meter, bypass counter
    assert n_rules == len(_rules(nft.table_commands(p)))


@pytest.mark.netns
def test_real_proxy_elements_add_and_delete(table: str) -> None:
    p = nft.TableParams(table, 15001, 15053, 8081, 7413, proxy_port=3128)
    nft.apply_table(p)
    plain = nft.Wiring("stkaaaaaaaaaa", "10.213.0.2", "02:00:0a:d5:00:02", "10.213.0.1")
    prox = nft.Wiring("stkbbbbbbbbbb", "10.213.0.6", "02:00:0a:d5:00:06", "10.213.0.5",
                      proxy=True)
    nft.run(nft.element_commands(table, "add", [plain, prox]))
    assert [nft.element_ifname(e) for e in nft.list_elements(table)[nft.SET_PROXY]] == [
        "stkbbbbbbbbbb"]
    # teardown builds its wiring without knowing the profile: both deletes succeed
    nft.run(nft.element_commands(table, "delete", [plain]))
    nft.run(nft.element_commands(table, "delete", [
        nft.Wiring(prox.ifname, prox.guest_ip, prox.guest_mac, prox.host_ip)]))
    assert {k: v for k, v in nft.list_elements(table).items()
            if k in nft.PER_SANDBOX_SETS and v} == {}
    listed = json.loads(subprocess.run(["nft", "-j", "list", "table", "inet", table],
                                       capture_output=True, check=True).stdout)["nftables"]
    assert sum(1 for i in listed if "rule" in i) == len(_rules(nft.table_commands(p)))
