"""The gateway with real clients in a client namespace against the fake internet.

Every gateway threat of ARCHITECTURE.md is one test here: the client is a real program
(curl, Python ssl/urllib, pip) in a network namespace whose TCP nftables redirects to
the gateway; the upstreams are the fake internet's servers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_harness import GatewayHarness, client_namespace, newest_event, pip_download

from stockade.testing.testnet import ClientNamespace, FakeInternet

pytestmark = pytest.mark.netns

CLIENT = str(Path(__file__).with_name("gw_client.py"))


def curl(
    ns: ClientNamespace, fi: FakeInternet, *args: str, timeout: int = 30
) -> subprocess.CompletedProcess[str]:
    return ns.run(
        ["curl", "-sS", "--max-time", "15", "--cacert", fi.ca_pem, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def client(ns: ClientNamespace, *args: str, timeout: int = 40) -> dict[str, Any]:
    r = ns.run([sys.executable, CLIENT, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def last_decision(gw: GatewayHarness, task: str, **match: Any) -> dict[str, Any]:
    """The newest decision event of `task` (waits briefly: events are written async)."""
    return newest_event(gw, "connection_decision", 5, labels__task_id=task, **match)


def ip(fi: FakeInternet, name: str) -> str:
    return fi.addresses[name]


@pytest.fixture
def fresh_ns(gw: GatewayHarness) -> Iterator[ClientNamespace]:
    ns = client_namespace(gw)
    try:
        yield ns
    finally:
        ns.stop()


# -- transparent TLS ---------------------------------------------------------------------


def test_allowed_https_through_transparent(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(
        sandbox, fake_internet, *fake_internet.resolve_args("allowed.test"), "https://allowed.test/"
    )
    assert r.returncode == 0, r.stderr
    assert "Hello from allowed.test" in r.stdout
    ev = last_decision(gw, "t-web", destination__domain="allowed.test")
    assert ev["stockade"]["decision"] == "allowed"
    assert ev["destination"]["ip"] == ip(fake_internet, "allowed.test")
    assert ev["rule"]["ruleset"] == gw.svc.rules.current.version  # type: ignore[union-attr]
    # and the close event carries the byte counts
    closes = [newest_event(gw, "connection_close", 5,
                           stockade__connection_id=ev["stockade"]["connection_id"])]
    assert closes and closes[0]["destination"]["bytes"] > 0
    assert closes[0]["source"]["bytes"] > 0


def test_spoofed_original_destination_is_not_dialled(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    """The client dials denied.test's address with SNI allowed.test: the gateway dials the
    address it resolved for allowed.test, so the answer comes from allowed.test."""
    forbidden_ip = ip(fake_internet, "denied.test")
    r = curl(
        sandbox,
        fake_internet,
        "--resolve",
        f"allowed.test:443:{forbidden_ip}",
        "https://allowed.test/",
    )
    assert r.returncode == 0, r.stderr
    assert "Hello from allowed.test" in r.stdout
    ev = last_decision(gw, "t-web", stockade__original_destination=f"{forbidden_ip}:443")
    assert ev["destination"]["ip"] == ip(fake_internet, "allowed.test")


def test_unlisted_name_is_refused_promptly(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(
        sandbox, fake_internet, *fake_internet.resolve_args("denied.test"), "https://denied.test/"
    )
    assert r.returncode != 0
    assert "alert" in r.stderr.lower() or "reset" in r.stderr.lower(), r.stderr
    ev = last_decision(gw, "t-web", destination__domain="denied.test")
    assert ev["stockade"]["decision"] == "denied"
    assert ev["event"]["reason"] == "no_matching_rule"


def test_ip_literal_https_without_sni_is_denied(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    target = ip(fake_internet, "allowed.test")
    r = curl(sandbox, fake_internet, "-k", f"https://{target}/")
    assert r.returncode != 0
    ev = last_decision(
        gw, "t-web", stockade__original_destination=f"{target}:443", event__reason="sni_missing"
    )
    assert ev["stockade"]["decision"] == "denied"


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("private.test", "private"),
        ("metadata.test", "metadata"),
        ("loopback.test", "loopback"),
        ("cgnat.test", "cgnat"),
        ("nat64.test", "ipv4_embedded"),
    ],
)
def test_allowed_name_resolving_to_forbidden_address(
    gw: GatewayHarness,
    sandbox: ClientNamespace,
    fake_internet: FakeInternet,
    name: str,
    category: str,
) -> None:
    r = curl(
        sandbox,
        fake_internet,
        "--resolve",
        f"{name}:443:{ip(fake_internet, 'allowed.test')}",
        "-k",
        f"https://{name}/",
    )
    assert r.returncode != 0
    ev = last_decision(gw, "t-web", destination__domain=name)
    assert ev["event"]["reason"] == "address_forbidden"
    assert "ip" not in ev["destination"]
    assert category in ev["message"] or "forbidden" in ev["message"]


def test_rebinding_never_dials_the_rebound_address(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    """rebind.test alternates between allowed.test's address and 127.0.0.1 (TTL 0); the
    resolver's cache is off in this gateway, so successive connections see both."""
    outcomes = set()
    for _ in range(4):
        pin = f"rebind.test:443:{ip(fake_internet, 'allowed.test')}"
        curl(sandbox, fake_internet, "--resolve", pin, "-k", "https://rebind.test/")
        ev = last_decision(gw, "t-web", destination__domain="rebind.test")
        outcomes.add(ev["event"]["reason"])
        if ev["stockade"]["decision"] == "allowed":
            assert ev["destination"]["ip"] == ip(fake_internet, "allowed.test")
    evs = [
        e for e in gw.decisions("t-web") if e.get("destination", {}).get("domain") == "rebind.test"
    ]
    assert all(e.get("destination", {}).get("ip") != "127.0.0.1" for e in evs)
    assert "address_forbidden" in outcomes


@pytest.mark.parametrize("sni", ["ALLOWED.TEST", "allowed.test.", "Allowed.Test."])
def test_case_and_trailing_dot_reach_the_same_host(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet, sni: str
) -> None:
    out = client(sandbox, "tls", ip(fake_internet, "denied.test"), "443", sni, "-")
    assert "Hello from allowed.test" in str(out.get("response")), out


def test_large_hello_split_across_records_and_segments(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    out = client(
        sandbox,
        "tls",
        ip(fake_internet, "allowed.test"),
        "443",
        "allowed.test",
        fake_internet.ca_pem,
        "200",
        "97",
    )
    assert out["hello_len"] > 1536  # type: ignore[operator]
    assert "Hello from allowed.test" in str(out.get("response")), out


def test_ech_and_two_snis_denied(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    sys.path.insert(0, os.path.dirname(CLIENT))
    from gw_tlsgen import hello_with_sni

    target = ip(fake_internet, "allowed.test")
    for hello, reason in (
        (hello_with_sni("allowed.test", ech=True), "ech_present"),
        (hello_with_sni("allowed.test", "denied.test"), "sni_missing"),
    ):
        out = client(sandbox, "slow", target, "443", hello.hex())
        assert bytes.fromhex(str(out["received"])).startswith(b"\x15\x03")  # a TLS alert
        last_decision(gw, "t-web", event__reason=reason)


def test_slow_loris_hits_the_deadline(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    out = client(sandbox, "slow", ip(fake_internet, "allowed.test"), "443", "160301")
    assert out["closed"] is True
    ev = last_decision(gw, "t-web", event__reason="sniff_timeout")
    assert ev["stockade"]["decision"] == "denied"


@pytest.mark.parametrize("name", ["inspect.test", "front.test"])
def test_flows_needing_the_inspector_fail_closed_without_it(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet, name: str
) -> None:
    """Inspection is off in this gateway: the TLS flow of an entry with `http` rules
    (inspect.test) or `host_must_match_sni` (front.test) is denied, never spliced (which
    would leave its requests, its Host, unchecked)."""
    r = curl(
        sandbox,
        fake_internet,
        "-k",
        "--resolve",
        f"{name}:443:{ip(fake_internet, 'allowed.test')}",
        f"https://{name}/",
    )
    assert r.returncode != 0
    ev = last_decision(
        gw, "t-web", destination__domain=name, event__reason="inspection_unavailable"
    )
    assert ev["stockade"]["decision"] == "denied"
    assert "inspection is disabled" in ev["message"]


# -- transparent plain HTTP ----------------------------------------------------------------


def test_plain_http_host_names_the_destination_not_the_ip(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(
        sandbox,
        fake_internet,
        "-i",
        "-H",
        "Host: denied.test",
        f"http://{ip(fake_internet, 'allowed.test')}/",
    )
    assert r.stdout, r.stderr
    assert "403" in r.stdout.splitlines()[0]
    assert "x-stockade-deny: no_matching_rule" in r.stdout.lower()
    body = json.loads(r.stdout.split("\n\n", 1)[1])
    assert body == {
        "error": "denied by stockade gateway",
        "reason": "no_matching_rule",
        "rule": None,
        "task": "t-web",
    }
    assert ip(fake_internet, "denied.test") not in r.stdout


def test_plain_http_allowed(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(
        sandbox,
        fake_internet,
        *fake_internet.resolve_args("allowed.test", 80),
        "http://allowed.test/",
    )
    assert r.returncode == 0 and "Hello from allowed.test" in r.stdout, r.stderr


def test_second_request_on_a_plain_http_connection_is_not_served(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    """Only the first request head is inspected, so the gateway makes it the last one
    (`Connection: close` upstream): a second request naming another Host on the same
    connection is never answered."""
    out = client(
        sandbox,
        "two-requests",
        ip(fake_internet, "allowed.test"),
        "80",
        "allowed.test",
        "denied.test",
    )
    assert " 200 " in str(out["first"])
    assert "connection: close" in str(out["first_head"]).lower()
    assert "HTTP/1." not in str(out["second"])


def _allowed_ip(fi: FakeInternet) -> str:
    return f"http://{ip(fi, 'allowed.test')}/"


# curl -i arguments (by the fake internet) -> the X-Stockade-Deny reason of the 403
PLAIN_HTTP_DENIALS = {
    "absolute_uri_vs_host_mismatch": (
        lambda fi: ["--request-target", "http://denied.test/", "-H", "Host: allowed.test",
                    _allowed_ip(fi)],
        "destination_mismatch",
    ),
    "port_confusion_in_host_header": (
        lambda fi: ["-H", "Host: allowed.test:8080", _allowed_ip(fi)], "destination_mismatch"),
    "oversized_head_gets_403": (
        lambda fi: ["-H", "X-Fill: " + "a" * 12000, *fi.resolve_args("allowed.test", 80),
                    "http://allowed.test/"],
        "head_too_large",
    ),
    "userinfo_in_host_is_refused": (
        lambda fi: ["-H", "Host: allowed.test@denied.test", _allowed_ip(fi)], "invalid_host"),
}


@pytest.mark.parametrize("case", list(PLAIN_HTTP_DENIALS))
def test_plain_http_head_is_denied(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet, case: str
) -> None:
    args, reason = PLAIN_HTTP_DENIALS[case]
    r = curl(sandbox, fake_internet, "-i", *args(fake_internet))
    assert f"x-stockade-deny: {reason}" in r.stdout.lower(), r.stdout[:300]


# -- raw TCP (cidr rule) and half-close ------------------------------------------------------


def test_raw_tcp_by_cidr_rule_with_half_close(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    echo_ip, echo_port = fake_internet.tcp_echo
    out = client(sandbox, "raw", echo_ip, str(echo_port), "ping-through-gateway")
    # the echo server only answers everything and closes after our FIN reached it
    assert out["received"] == "ping-through-gateway"
    ev = last_decision(gw, "t-web", destination__ip=echo_ip)
    assert ev["network"]["protocol"] == "tcp"


def test_raw_tcp_without_cidr_rule_is_denied(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    out = client(sandbox, "raw", ip(fake_internet, "allowed.test"), "22", "SSH-2.0-x\r\n")
    # nothing was relayed (an upper-case first byte is read as HTTP, so a 403 may come back)
    assert "SSH-2.0" not in out["received"]
    last_decision(
        gw,
        "t-web",
        event__reason="protocol_unrecognised",
        stockade__original_destination=f"{ip(fake_internet, 'allowed.test')}:22",
    )


# -- explicit proxy ------------------------------------------------------------------------


def proxy_url(gw: GatewayHarness, ns: ClientNamespace) -> str:
    return f"http://{ns.host_ip}:{gw.port('proxy')}"


def test_proxy_connect_allowed(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(sandbox, fake_internet, "-x", proxy_url(gw, sandbox), "https://allowed.test/")
    assert r.returncode == 0 and "Hello from allowed.test" in r.stdout, r.stderr
    ev = last_decision(gw, "t-web", stockade__listener="proxy", destination__domain="allowed.test")
    assert ev["stockade"]["decision"] == "allowed"


def test_proxy_connect_denied_gets_403(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(sandbox, fake_internet, "-v", "-x", proxy_url(gw, sandbox), "https://denied.test/")
    assert r.returncode != 0
    assert "403" in r.stderr and "x-stockade-deny: no_matching_rule" in r.stderr.lower()


def test_a_reload_changes_the_verdict_for_a_connect_seen_before(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet, rules_dir: Path
) -> None:
    """CONNECT verdicts are memoised per rule set: a new rule set must not reuse them."""
    url = "https://allowed.test/"
    assert curl(sandbox, fake_internet, "-x", proxy_url(gw, sandbox), url).returncode == 0
    web = rules_dir / "profiles" / "web.yaml"
    original = web.read_text()
    try:
        web.write_text(original.replace("- host: allowed.test", "- host: allowed-not.test"))
        assert gw.control.reload()["ok"]
        r = curl(sandbox, fake_internet, "-v", "-x", proxy_url(gw, sandbox), url)
        assert r.returncode != 0 and "x-stockade-deny: no_matching_rule" in r.stderr.lower()
    finally:
        web.write_text(original)
        assert gw.control.reload()["ok"]
    assert curl(sandbox, fake_internet, "-x", proxy_url(gw, sandbox), url).returncode == 0


def test_ip_literal_connect_is_denied(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(
        sandbox,
        fake_internet,
        "-v",
        "-k",
        "-x",
        proxy_url(gw, sandbox),
        f"https://{ip(fake_internet, 'allowed.test')}/",
    )
    assert r.returncode != 0 and "403" in r.stderr


def test_connect_authority_vs_sni_mismatch(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    out = client(
        sandbox,
        "connect-tls",
        sandbox.host_ip,
        str(gw.port("proxy")),
        "allowed.test:443",
        "denied.test",
    )
    assert "200" in str(out["connect"])
    assert "response" not in out and "error" in out
    last_decision(gw, "t-web", stockade__listener="proxy", event__reason="destination_mismatch")


def test_absolute_uri_fronting(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(
        sandbox,
        fake_internet,
        "-i",
        "-x",
        proxy_url(gw, sandbox),
        "-H",
        "Host: allowed.test",
        "http://denied.test/",
    )
    assert "x-stockade-deny: destination_mismatch" in r.stdout.lower(), r.stdout[:300]
    r = curl(sandbox, fake_internet, "-x", proxy_url(gw, sandbox), "http://allowed.test/")
    assert r.returncode == 0 and "Hello from allowed.test" in r.stdout


def test_python_urllib_through_proxy(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    code = (
        "import ssl,urllib.request,sys\n"
        "ctx=ssl.create_default_context(cafile=sys.argv[1])\n"
        "h=urllib.request.ProxyHandler({'https':sys.argv[2]})\n"
        "o=urllib.request.build_opener(h,urllib.request.HTTPSHandler(context=ctx))\n"
        "print(o.open('https://echo.test/echo',timeout=15).read().decode())\n"
    )
    r = sandbox.run(
        [sys.executable, "-c", code, fake_internet.ca_pem, proxy_url(gw, sandbox)],
        capture_output=True,
        text=True,
        timeout=40,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["method"] == "GET"


def test_pip_download_through_proxy(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet, tmp_path: Path
) -> None:
    r = pip_download(sandbox, tmp_path, proxy_url(gw, sandbox), "--cert", fake_internet.ca_pem)
    assert r.returncode == 0, r.stdout + r.stderr
    assert any(p.suffix == ".whl" for p in tmp_path.iterdir())


# -- identity, limits, report mode, lifecycle -------------------------------------------------


def test_unknown_source_address_is_denied(
    gw: GatewayHarness, fresh_ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(
        fresh_ns,
        fake_internet,
        "-i",
        *fake_internet.resolve_args("allowed.test", 80),
        "http://allowed.test/",
    )
    assert "x-stockade-deny: unknown_task" in r.stdout.lower()
    evs = [e for e in gw.decisions() if e["source"]["ip"] == fresh_ns.address]
    assert evs and evs[-1]["event"]["reason"] == "unknown_task"


def test_report_mode_proceeds_and_says_so(
    gw: GatewayHarness, fresh_ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    gw.register("t-watch", fresh_ns.address, "watch")
    try:
        r = curl(
            fresh_ns,
            fake_internet,
            *fake_internet.resolve_args("denied.test"),
            "https://denied.test/",
        )
        assert r.returncode == 0 and "denied.test" in r.stdout, r.stderr
        ev = last_decision(gw, "t-watch", destination__domain="denied.test")
        assert ev["stockade"]["decision"] == "allowed"
        assert ev["stockade"]["report_only"] is True
        assert ev["event"]["reason"] == "no_matching_rule"
    finally:
        gw.control.deregister("t-watch")


def test_upload_cap_closes_the_connection(
    gw: GatewayHarness, fresh_ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    gw.register("t-tiny", fresh_ns.address, "tiny")
    try:
        out = client(
            fresh_ns,
            "upload",
            ip(fake_internet, "allowed.test"),
            "443",
            "allowed.test",
            str(512 * 1024),
        )
        assert '"received": 524288' not in str(out.get("response", ""))
        closes = [newest_event(gw, "connection_close", 5, labels__task_id="t-tiny")]
        assert closes[-1]["event"]["reason"] == "upload_limit"
        assert closes[-1]["source"]["bytes"] <= 64 * 1024
    finally:
        gw.control.deregister("t-tiny")


def test_connection_cap_per_task(
    gw: GatewayHarness, fresh_ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    gw.register("t-cap", fresh_ns.address, "web")
    holders = []
    try:
        for _ in range(8):
            p = fresh_ns.popen(
                [
                    sys.executable,
                    CLIENT,
                    "hold",
                    ip(fake_internet, "allowed.test"),
                    "443",
                    "allowed.test",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            holders.append(p)
            assert p.stdout is not None
            assert json.loads(p.stdout.readline())["ready"]
        r = curl(
            fresh_ns,
            fake_internet,
            "-i",
            *fake_internet.resolve_args("allowed.test", 80),
            "http://allowed.test/",
        )
        assert "x-stockade-deny: connection_limit" in r.stdout.lower()
    finally:
        gw.control.deregister("t-cap")  # also closes the held tunnels
        for p in holders:
            p.wait(timeout=30)


def test_deregistration_closes_live_connections(
    gw: GatewayHarness, fresh_ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    gw.register("t-bye", fresh_ns.address, "web")
    p = fresh_ns.popen(
        [sys.executable, CLIENT, "hold", ip(fake_internet, "allowed.test"), "443", "allowed.test"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    assert json.loads(p.stdout.readline())["ready"]
    gw.control.deregister("t-bye")
    out = json.loads(p.stdout.readline())
    assert out["closed"] is True
    p.wait(timeout=30)
    # the close event is written a moment after the tunnel closed
    closes = [newest_event(gw, "connection_close", 5, labels__task_id="t-bye")]
    assert closes and closes[-1]["event"]["reason"] == "task_ended"


def test_a_flow_cut_short_by_its_tasks_end_is_still_decided(
    gw: GatewayHarness, fresh_ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    # the connection sends nothing: its flow is undecided (awaiting its first bytes, up
    # to sniff_timeout_s) when the task ends, and must still count as one decision
    gw.register("t-mute", fresh_ns.address, "web")
    p = fresh_ns.popen([sys.executable, CLIENT, "mute", ip(fake_internet, "allowed.test"), "443"],
                       stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert json.loads(p.stdout.readline())["ready"]
    time.sleep(0.2)  # accepted and admitted by the gateway (far inside the sniff timeout)
    gw.control.deregister("t-mute")
    assert json.loads(p.stdout.readline())["closed"] is True
    p.wait(timeout=30)
    ev = newest_event(gw, "connection_decision", 5, labels__task_id="t-mute")
    assert ev["event"]["reason"] == "task_ended"
    assert ev["stockade"]["decision"] == "denied"
    assert ev["destination"]["port"] == 443
    decisions = [e for e in gw.events() if e["event"]["action"] == "connection_decision"
                 and e.get("labels", {}).get("task_id") == "t-mute"]
    assert len(decisions) == 1, decisions


def test_expiry_closes_live_connections(
    gw: GatewayHarness, fresh_ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    gw.register("t-exp", fresh_ns.address, "web", expires_at=time.time() + 3)
    p = fresh_ns.popen(
        [sys.executable, CLIENT, "hold", ip(fake_internet, "allowed.test"), "443", "allowed.test"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    assert json.loads(p.stdout.readline())["ready"]
    out = json.loads(p.stdout.readline())  # returns once the gateway closed the tunnel
    assert out["closed"] is True
    p.wait(timeout=30)
    assert all(t.task_id != "t-exp" for t in gw.control.list())


def test_metrics_endpoint(
    gw: GatewayHarness, sandbox: ClientNamespace, fake_internet: FakeInternet
) -> None:
    import urllib.request

    def closes() -> list[dict[str, Any]]:
        return [e for e in gw.events() if e["event"]["action"] == "connection_close"]

    def scrape() -> str:
        host, port = gw.config.gateway.metrics_listen.rsplit(":", 1)
        return urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()

    before = len(closes())
    r = curl(  # one allowed tunnel of its own: the test does not rely on the others'
        sandbox, fake_internet, *fake_internet.resolve_args("allowed.test"), "https://allowed.test/"
    )
    assert r.returncode == 0, r.stderr
    assert gw.svc is not None
    for _ in range(100):  # its close (and any earlier test's) written, nothing in flight
        if len(closes()) > before and not gw.run(_live_conns(gw)):
            break
        time.sleep(0.1)
    first, text, again = closes(), scrape(), closes()
    assert len(first) == len(again) > before  # no close landed between the two reads
    assert 'stockade_gateway_decisions_total{outcome="allowed",profile="web"' in text
    assert "stockade_gateway_decision_seconds_bucket" in text
    assert "stockade_gateway_registry_tasks" in text
    assert "stockade_gateway_connections_live" in text
    # the byte counters agree with the close events (both written by the same close)
    for direction, side in (("up", "source"), ("down", "destination")):
        line = f'stockade_gateway_bytes_total{{direction="{direction}"}} '
        value = float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])
        assert value == sum(e.get(side, {}).get("bytes", 0) for e in first)


async def _live_conns(gw: GatewayHarness) -> int:
    """Connections the gateway still tracks, plus events it has not written yet (read on
    its own loop thread)."""
    assert gw.svc is not None
    return len(gw.svc.gateway.conns) + len(gw.svc.gateway._deferred)


def test_control_socket_is_private(gw: GatewayHarness) -> None:
    mode = os.stat(gw.config.gateway.control_socket).st_mode & 0o777
    assert mode == 0o600


def test_every_event_validates(gw: GatewayHarness, sandbox: ClientNamespace) -> None:
    evs = gw.events()  # validate() runs on each
    assert evs
    assert all(
        "rule" in e and e["rule"].get("ruleset")
        for e in evs
        if e["event"]["action"] == "connection_decision"
    )
