"""The launcher's nftables table, built as `nft -j` JSON by pure functions.

Hand-written because the table is small and fixed: one inet table, sets keyed by the
host-side interface name, so the rule count never grows with the number of sandboxes and
adding or removing a sandbox is one atomic transaction of set elements. The JSON form
(not text) means no value is ever parsed as nft syntax.

Chains (all traffic that enters from a sandbox interface):
- `redirect_in` (nat, prerouting dstnat): broker address/port exempt; for sandboxes of a
  `proxy_env` profile only (set `sandbox_proxy`), their host-side address on the gateway's
  explicit proxy port exempt too; port 53 UDP/TCP to the gateway's DNS firewall; every other
  TCP to the gateway's transparent listener.
- `guard_in` (filter, prerouting dstnat+10, after the redirect): IPv6 logged and dropped;
  a source that is not the interface's (name, IPv4, MAC) logged and dropped; traffic to the
  interface's host-side address on the gateway/DNS/broker ports (and, for `sandbox_proxy`
  members, the explicit proxy port) accepted; everything else
  logged (NFLOG group, rate-limited) and rejected (TCP reset / ICMP admin-prohibited).
- `forward_guard` (filter, forward): a backstop, nothing is forwarded to or from sandboxes.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any

Json = dict[str, Any]

# NFLOG prefixes: the reader turns these into the event reason detail
PREFIX_IPV6 = "stockade:ipv6"
PREFIX_SPOOF = "stockade:spoof"
PREFIX_BLOCKED = "stockade:blocked"
PREFIX_FORWARD = "stockade:forward"

SET_IFS = "sandbox_ifs"
SET_SRC = "sandbox_src"
SET_HOST = "sandbox_host"
# (veth, host-side address) of sandboxes whose profile sets `egress.proxy_env`: only these
# reach the gateway's explicit proxy listener. Everyone else's traffic to that port is
# redirected to the transparent listener like any other TCP, as before the option existed:
# the gateway still decides (and reports) it, and no sandbox gets a path it did not ask for.
SET_PROXY = "sandbox_proxy"
# a meter: one log budget per interface, so one noisy sandbox cannot use up the log rate
# of the others; its elements expire by themselves (never deleted, never reconciled)
SET_LOG_BUDGET = "log_budget"
LOG_BUDGET_TIMEOUT_S = 10
# a counter per interface of every packet that reaches a log rule, logged or over the log
# limit: the launcher reads it at teardown (logged + unlogged = attempts) and deletes the
# element; an element left by a crash expires by itself (the timeout is refreshed by
# every packet, and is far longer than any sandbox's TTL between two blocked packets)
SET_BYPASS_COUNT = "bypass_count"
BYPASS_COUNT_TIMEOUT_S = 7 * 86400
PER_SANDBOX_SETS = (SET_IFS, SET_SRC, SET_HOST, SET_PROXY)


@dataclass(frozen=True, slots=True)
class TableParams:
    table: str
    transparent_port: int
    dns_port: int
    broker_port: int
    nflog_group: int
    log_rate: int = 20
    # port of the gateway's explicit proxy listener (`gateway.proxy_listen[0]`), exempted
    # from the redirect for `SET_PROXY` members only; None: no proxy rules at all
    proxy_port: int | None = None


@dataclass(frozen=True, slots=True)
class Wiring:
    """What the table needs to know about one sandbox."""

    ifname: str  # host side of the veth
    guest_ip: str
    guest_mac: str
    host_ip: str
    proxy: bool = False  # the profile sets egress.proxy_env: element in SET_PROXY


def _iif() -> Json:
    return {"meta": {"key": "iifname"}}


def _payload(proto: str, field: str) -> Json:
    return {"payload": {"protocol": proto, "field": field}}


def _match(left: Any, right: Any, op: str = "==") -> Json:
    return {"match": {"op": op, "left": left, "right": right}}


def _log(p: TableParams, prefix: str) -> list[Json]:
    # every log is paired with a limit (per interface), so a flood cannot flood the log;
    # the counter before it counts what the limit keeps out of the log too
    return [
        {"set": {"op": "update", "elem": _iif(), "set": "@" + SET_BYPASS_COUNT,
                 "stmt": [{"counter": None}]}},
        {"set": {"op": "update", "elem": _iif(), "set": "@" + SET_LOG_BUDGET,
                 "stmt": [{"limit": {"rate": p.log_rate, "burst": p.log_rate * 2,
                                     "per": "second"}}]}},
        {"log": {"prefix": prefix, "group": p.nflog_group}},
    ]


def _rule(p: TableParams, chain: str, *expr: Json) -> Json:
    return {"add": {"rule": {"family": "inet", "table": p.table, "chain": chain,
                             "expr": list(expr)}}}


def _chain(p: TableParams, name: str, **hook: Any) -> Json:
    return {"add": {"chain": {"family": "inet", "table": p.table, "name": name, **hook}}}


def _set(p: TableParams, name: str, type_: str | list[str]) -> Json:
    return {"add": {"set": {"family": "inet", "table": p.table, "name": name, "type": type_}}}


def table_commands(p: TableParams, existing_sets: frozenset[str] = frozenset()) -> Json:
    """The whole table; idempotent: `add table` then `flush table`, then everything.

    `existing_sets`: sets the table already has. The meter set is only created when
    missing: the kernel marks it dynamic once a rule updates it, and re-adding it with
    the flags JSON can express would then fail.
    """
    cmds: list[Json] = [
        {"add": {"table": {"family": "inet", "name": p.table}}},
        # flush only *this* table's rules (sets keep their elements: sandboxes survive reload)
        {"flush": {"table": {"family": "inet", "name": p.table}}},
        *_sets(p, existing_sets),
        _chain(p, "redirect_in", type="nat", hook="prerouting", prio=-100, policy="accept"),
        _chain(p, "guard_in", type="filter", hook="prerouting", prio=-90, policy="accept"),
        _chain(p, "from_sandbox"),
        _chain(p, "forward_guard", type="filter", hook="forward", prio=0, policy="accept"),
        *_redirect_rules(p),
        _rule(p, "guard_in", _match(_iif(), "@" + SET_IFS), {"jump": {"target": "from_sandbox"}}),
        *_from_sandbox_rules(p),
        # -- forward_guard: a backstop; guard_in already rejected all of it
        _rule(p, "forward_guard", _match(_iif(), "@" + SET_IFS), *_log(p, PREFIX_FORWARD)),
        _rule(p, "forward_guard", _match(_iif(), "@" + SET_IFS), {"drop": None}),
        _rule(p, "forward_guard", _match({"meta": {"key": "oifname"}}, "@" + SET_IFS),
              {"drop": None}),
    ]
    return {"nftables": cmds}


def _sets(p: TableParams, existing_sets: frozenset[str]) -> list[Json]:
    timed = [(SET_LOG_BUDGET, LOG_BUDGET_TIMEOUT_S), (SET_BYPASS_COUNT, BYPASS_COUNT_TIMEOUT_S)]
    return [
        _set(p, SET_IFS, "ifname"),
        _set(p, SET_SRC, ["ifname", "ipv4_addr", "ether_addr"]),
        _set(p, SET_HOST, ["ifname", "ipv4_addr"]),
        _set(p, SET_PROXY, ["ifname", "ipv4_addr"]),
        *({"add": {"set": {"family": "inet", "table": p.table, "name": name, "type": "ifname",
                           "flags": ["timeout"], "timeout": timeout, "size": 65536}}}
          for name, timeout in timed if name not in existing_sets),
    ]


def _host_dst() -> Json:
    return {"concat": [_iif(), _payload("ip", "daddr")]}


def _l4() -> Json:
    return {"meta": {"key": "l4proto"}}


def _proxy_rule(p: TableParams, chain: str) -> list[Json]:
    # a member's own host-side address on the explicit proxy port: no redirect (the
    # listener sees the sandbox's real source and destination), accepted by the guard
    if p.proxy_port is None:
        return []
    return [_rule(p, chain, _match(_host_dst(), "@" + SET_PROXY),
                  _match(_payload("tcp", "dport"), p.proxy_port), {"accept": None})]


def _redirect_rules(p: TableParams) -> list[Json]:
    return [
        _rule(p, "redirect_in", _match(_iif(), "@" + SET_IFS, "!="), {"return": None}),
        _rule(p, "redirect_in", _match(_host_dst(), "@" + SET_HOST),
              _match(_payload("tcp", "dport"), p.broker_port), {"accept": None}),
        *_proxy_rule(p, "redirect_in"),
        _rule(p, "redirect_in", _match(_l4(), {"set": ["tcp", "udp"]}),
              _match(_payload("th", "dport"), 53), {"redirect": {"port": p.dns_port}}),
        _rule(p, "redirect_in", _match(_l4(), "tcp"), {"redirect": {"port": p.transparent_port}}),
    ]


def _from_sandbox_rules(p: TableParams) -> list[Json]:
    src = {"concat": [_iif(), _payload("ip", "saddr"), _payload("ether", "saddr")]}
    v6 = _match({"meta": {"key": "nfproto"}}, "ipv6")
    return [
        _rule(p, "from_sandbox", v6, *_log(p, PREFIX_IPV6)),
        _rule(p, "from_sandbox", v6, {"drop": None}),
        # spoofed: dropped without an answer (the answer would go to the forged address)
        _rule(p, "from_sandbox", _match(src, "@" + SET_SRC, "!="), *_log(p, PREFIX_SPOOF)),
        _rule(p, "from_sandbox", _match(src, "@" + SET_SRC, "!="), {"drop": None}),
        _rule(p, "from_sandbox", _match(_host_dst(), "@" + SET_HOST),
              _match(_payload("tcp", "dport"),
                     {"set": sorted({p.transparent_port, p.dns_port, p.broker_port})}),
              {"accept": None}),
        _rule(p, "from_sandbox", _match(_host_dst(), "@" + SET_HOST),
              _match(_payload("udp", "dport"), p.dns_port), {"accept": None}),
        *_proxy_rule(p, "from_sandbox"),
        _rule(p, "from_sandbox", *_log(p, PREFIX_BLOCKED)),
        _rule(p, "from_sandbox", _match(_l4(), "tcp"), {"reject": {"type": "tcp reset"}}),
        _rule(p, "from_sandbox", {"reject": {"type": "icmpx", "expr": "admin-prohibited"}}),
    ]


def _elements(table: str, w: Wiring) -> list[tuple[str, list[Any]]]:
    return [
        (SET_IFS, [w.ifname]),
        (SET_SRC, [{"concat": [w.ifname, w.guest_ip, w.guest_mac]}]),
        (SET_HOST, [{"concat": [w.ifname, w.host_ip]}]),
    ]


def element_commands(table: str, verb: str, wirings: list[Wiring]) -> Json:
    """One transaction adding (`add`) or removing (`delete`) sandboxes' set elements.

    `add` puts a `Wiring.proxy` sandbox into `SET_PROXY` too. `delete` always removes the
    `SET_PROXY` element, whatever `Wiring.proxy` says, as `add` + `delete` in the same
    batch (adding an existing element is no error, deleting a missing one is): teardown
    and crash recovery need not know the sandbox's profile, and still one transaction.
    """
    if verb not in ("add", "delete"):
        raise ValueError(verb)
    cmds: list[Json] = []

    def element(v: str, name: str, elem: list[Any]) -> Json:
        return {v: {"element": {"family": "inet", "table": table, "name": name, "elem": elem}}}

    for w in wirings:
        for name, elem in _elements(table, w):
            cmds.append(element(verb, name, elem))
        proxy = [{"concat": [w.ifname, w.host_ip]}]
        if verb == "delete":
            # the bypass counter's element too (made by the rules, read at teardown)
            cmds.append(element("add", SET_BYPASS_COUNT, [w.ifname]))
            cmds.append(element("delete", SET_BYPASS_COUNT, [w.ifname]))
            cmds.append(element("add", SET_PROXY, proxy))
            cmds.append(element("delete", SET_PROXY, proxy))
        elif w.proxy:
            cmds.append(element("add", SET_PROXY, proxy))
    return {"nftables": cmds}


def apply_table(p: TableParams) -> None:
    """Create or refresh the table (keeps every set's elements)."""
    run(table_commands(p, frozenset(list_elements(p.table))))


def delete_table_command(table: str) -> Json:
    return {"nftables": [{"delete": {"table": {"family": "inet", "name": table}}}]}


class NftError(RuntimeError):
    pass


def run(payload: Json) -> None:
    """Apply one JSON batch atomically (nft applies a whole batch or nothing)."""
    proc = subprocess.run(["nft", "-j", "-f", "-"], input=json.dumps(payload).encode(),
                          capture_output=True, check=False)
    if proc.returncode != 0:
        raise NftError(proc.stderr.decode("utf-8", "replace").strip()[:2000])


def list_elements(table: str) -> dict[str, list[Any]]:
    """Set name -> elements as nft reports them (for reconcile and tests)."""
    proc = subprocess.run(["nft", "-j", "list", "table", "inet", table],
                          capture_output=True, check=False)
    if proc.returncode != 0:
        return {}
    out: dict[str, list[Any]] = {}
    for item in json.loads(proc.stdout).get("nftables", []):
        s = item.get("set")
        if s is not None:
            out[s["name"]] = s.get("elem", [])
    return out


def bypass_count(table: str, ifname: str) -> int:
    """Packets of `ifname` that reached a log rule (0 when none did or on any error)."""
    proc = subprocess.run(["nft", "-j", "list", "set", "inet", table, SET_BYPASS_COUNT],
                          capture_output=True, check=False)
    if proc.returncode != 0:
        return 0
    for item in json.loads(proc.stdout).get("nftables", []):
        for e in (item.get("set") or {}).get("elem", []):
            inner = e.get("elem", {}) if isinstance(e, dict) else {}
            if inner.get("val") == ifname:
                return int(inner.get("counter", {}).get("packets", 0))
    return 0


def table_exists(table: str) -> bool:
    return subprocess.run(["nft", "list", "table", "inet", table], capture_output=True,
                          check=False).returncode == 0


def element_ifname(elem: Any) -> str | None:
    """The interface name of one listed element (plain or concatenation)."""
    if isinstance(elem, str):
        return elem
    if isinstance(elem, dict):
        if "concat" in elem:
            first = elem["concat"][0]
            return first if isinstance(first, str) else None
        if "elem" in elem:
            return element_ifname(elem["elem"].get("val"))
    return None
