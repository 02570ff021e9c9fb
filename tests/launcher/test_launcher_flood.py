"""A UDP flood from one sandbox (real nftables, NFLOG, launcher): every packet is either
a verbatim `bypass_attempt` event or counted in a summary (the throttle's, or the
launcher's own for packets over the nft log limit, counted by the nft counter), the
first denial is still in the run's result, and the task's event bytes stay bounded."""

from __future__ import annotations

import json
from typing import Any

import pytest
from stockade.launcher import nft

from stockade.events import validate
from stockade.events.taskstore import read_task_events, task_file

from .conftest import Lab

pytestmark = pytest.mark.netns

FLOOD = r"""
import json, os, socket, sys
gw = os.environ["STOCKADE_BROKER"].split("//")[1].split(":")[0]  # host side of the veth
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.sendto(b"first", (gw, 7))  # the denial that must survive the flood
n = int(sys.argv[1])
sent = 1
for i in range(n):
    try:
        s.sendto(b"x", (gw, 1000 + i % 50000))
        sent += 1
    except OSError:  # an ICMP error of an earlier reject, queued on the socket
        pass
print(json.dumps({"sent": sent}))
"""


def _attempts_in(events: list[dict[str, Any]]) -> int:
    n = 0
    for e in events:
        act = e["event"]["action"]
        if act == "bypass_attempt":
            n += 1
        elif act == "event_summary" and e["stockade"]["summary"]["action"] == "bypass_attempt":
            n += e["stockade"]["summary"]["count"]
    return n


def test_udp_flood_is_counted_to_the_packet(lab: Lab) -> None:
    n = 5000
    res = lab.run(["python3", "-c", FLOOD, str(n)])
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    stored = read_task_events(lab.config.task_events_dir, res.task_id)
    for e in stored:
        validate(e)
    (end,) = [e for e in stored if e["event"]["action"] == "sandbox_lifecycle"
              and e["stockade"].get("lifecycle") == "end"]
    bypass = end["stockade"]["bypass"]
    # only this sandbox's own packets reach its counter; spontaneous IPv6 (router or
    # neighbour solicitations) would be counted and reported as ipv6 bypass attempts
    ipv6 = sum(1 for e in stored if e.get("rule", {}).get("id") == "launcher:ipv6")
    assert bypass["attempts"] >= out["sent"]
    assert bypass["attempts"] - out["sent"] <= ipv6 + bypass["unlogged"]
    # every attempt is an event or in exactly one summary
    assert _attempts_in(stored) == bypass["attempts"]
    assert bypass["unlogged"] > 0  # the nft log limit kept most of them out of NFLOG
    # the first denial is still there, verbatim, in the run's result
    assert any(d["event"]["action"] == "bypass_attempt"
               and d.get("destination", {}).get("port") == 7 for d in res.denials)
    # the launcher's totals are in the end event
    assert end["stockade"]["event_totals"]["launcher"]["written"] >= 1
    # bounded: 20 verbatim per key + a few summaries, nowhere near one line per packet
    size = task_file(lab.config.task_events_dir, res.task_id).stat().st_size  # type: ignore[union-attr]
    assert size < 64 * 1024, size
    # the counter's element went with the sandbox
    assert nft.bypass_count(lab.config.launcher.nft_table, f"{lab.config.launcher.name_prefix}"
                            f"{res.task_id}") == 0


def test_every_log_rule_counts_per_interface_before_its_limit() -> None:
    p = nft.TableParams("stockade_unit", 15001, 15053, 8081, 7413, log_rate=20)
    rules = [c["add"]["rule"] for c in nft.table_commands(p)["nftables"]
             if "rule" in c.get("add", {})]
    logs = [r for r in rules if any("log" in e for e in r["expr"])]
    assert len(logs) == 4
    for r in logs:
        first = r["expr"][[next(iter(e)) for e in r["expr"]].index("set")]["set"]
        assert first["set"] == "@" + nft.SET_BYPASS_COUNT
        assert first["elem"] == {"meta": {"key": "iifname"}}
        assert first["stmt"] == [{"counter": None}]
