"""Fronting inside TLS, end to end: an entry with `host_must_match_sni: true` goes through
the real inspector only so that every request's Host (HTTP/1) / :authority (HTTP/2)
names the SNI, on every request of a connection; methods and paths are not limited.
Without the field the entry is spliced after the SNI check, as before: a Host inside
TLS is never seen (pinned below, so the choice stays visible)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_harness import GatewayHarness, fake_internet_config, registered_client, running_gateway
from test_gw_inspection import ca, curl, find_event, split

from stockade.testing.testnet import ClientNamespace, FakeInternet

pytestmark = pytest.mark.netns

FRONT = """\
profile: front
description: a shared front-end entry held to Host = SNI, and one spliced as before
egress:
  allow:
    - host: echo.test
      id: echo-front
      reason: a CDN-style entry; any method and path, but only under its own name
      host_must_match_sni: true
    - host: allowed.test
      id: allowed-spliced
      reason: uninspected (spliced after the SNI check)
"""

# Two requests on ONE TLS connection (HTTP/1.1 keep-alive, or two HTTP/2 streams), the
# second naming `argv[4]`; prints [[status, X-Stockade-Deny, body], ...] as JSON.
TWO_REQUESTS = r"""
import json, socket, ssl, sys
mode, ip, cafile, second = sys.argv[1:5]
ctx = ssl.create_default_context(cafile=cafile)
ctx.set_alpn_protocols(["h2" if mode == "h2" else "http/1.1"])
sock = ctx.wrap_socket(socket.create_connection((ip, 443), timeout=20),
                       server_hostname="echo.test")
out = []
if mode == "h1":
    import http.client
    conn = http.client.HTTPSConnection("echo.test", 443, context=ctx, timeout=20)
    conn.sock = sock
    for path, host in (("/first/path", "echo.test"), ("/second/path", second)):
        conn.request("GET", path, headers={"Host": host})
        r = conn.getresponse()
        out.append([r.status, r.getheader("X-Stockade-Deny"), r.read().decode()])
else:
    import h2.config, h2.connection, h2.events
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    c.initiate_connection()
    sock.sendall(c.data_to_send())
    for sid, path, host in ((1, "/first/path", "echo.test"), (3, "/second/path", second)):
        c.send_headers(sid, [(":method", "GET"), (":scheme", "https"),
                             (":authority", host), (":path", path)], end_stream=True)
        sock.sendall(c.data_to_send())
        status, deny, body, done = 0, None, b"", False
        while not done:
            data = sock.recv(65536)
            if not data:
                break
            for ev in c.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                    hd = dict(ev.headers)
                    status = int(hd[b":status"])
                    deny = hd.get(b"x-stockade-deny", b"").decode() or None
                elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                    body += ev.data
                    c.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    done = done or ev.stream_id == sid
            sock.sendall(c.data_to_send())
        out.append([status, deny, body.decode()])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fgw(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHarness]:
    cfg = fake_internet_config(
        tmp_path_factory.mktemp("fronting"),
        fake_internet,
        {"front": FRONT},
        sniff_timeout_s=3.0,
        dns={"ttl_min_s": 0},
        # upstream_first off: the fake internet speaks HTTP/1.1 only, and the h2 cases
        # need an HTTP/2 client connection to the inspector (which that setting would
        # turn into HTTP/1.1)
        inspection={
            "upstream_ca_file": fake_internet.ca_pem,
            "restart_delay_s": 1.0,
            "upstream_first": False,
        },
    )
    with running_gateway(cfg, inspector=True) as h:
        yield h


@pytest.fixture(scope="module")
def fns(fgw: GatewayHarness) -> Iterator[ClientNamespace]:
    with registered_client(fgw, "t-front", "front", "fr") as ns:
        yield ns


def two_requests(
    ns: ClientNamespace, fi: FakeInternet, gw: GatewayHarness, mode: str, second: str
) -> list[list[Any]]:
    r = ns.run(
        [sys.executable, "-c", TWO_REQUESTS, mode, fi.addresses["echo.test"], ca(gw), second],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
@pytest.mark.parametrize(
    "args",
    [
        ["https://echo.test/any/deep/path.whl?x=1"],
        ["-X", "POST", "--data", "a=b", "https://echo.test/upload/here"],
        ["-X", "DELETE", "https://echo.test/"],
    ],
)
def test_the_right_host_passes_with_any_method_and_path(
    fgw: GatewayHarness, fns: ClientNamespace, fake_internet: FakeInternet, http: str,
    args: list[str],
) -> None:  # fmt: skip
    r = curl(fns, fake_internet, fgw, "echo.test", http, *args)
    assert r.returncode == 0, r.stderr
    status, _, body = split(r)
    assert status == 200, r.stdout
    doc = json.loads(body)
    assert doc["host"] == "echo.test" and doc["headers"]["Host"] == "echo.test"
    method = args[1] if args[0] == "-X" else "GET"
    assert doc["method"] == method
    path = args[-1].removeprefix("https://echo.test").split("?")[0]
    req = find_event(fgw, "request_decision", labels__task_id="t-front", url__path=path,
                     http__request__method=method)  # fmt: skip
    assert req["stockade"]["decision"] == "allowed"
    assert req["event"]["reason"] == "allowed_by_rule" and req["rule"]["id"] == "echo-front"
    conn = find_event(fgw, "connection_decision",
                      stockade__connection_id=req["stockade"]["connection_id"])  # fmt: skip
    assert conn["event"]["reason"] == "inspected"


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
@pytest.mark.parametrize("host", ["other.test", "allowed.test", "echo.test:8443"])
def test_another_host_inside_tls_is_refused(
    fgw: GatewayHarness, fns: ClientNamespace, fake_internet: FakeInternet, http: str, host: str
) -> None:
    """`curl -H 'Host: other.test' https://echo.test/`: the fronting attempt. Even a name
    the profile allows elsewhere (allowed.test) or another port is refused."""
    r = curl(fns, fake_internet, fgw, "echo.test", http, "-H", f"Host: {host}",
             "https://echo.test/front")  # fmt: skip
    assert r.returncode == 0, r.stderr
    status, headers, body = split(r)
    assert status == 403 and headers["x-stockade-deny"] == "destination_mismatch", r.stdout
    doc = json.loads(body)
    assert doc["reason"] == "destination_mismatch" and doc["task"] == "t-front"
    assert doc["rule"] is None
    ev = find_event(fgw, "request_decision", labels__task_id="t-front",
                    stockade__request_host=host, url__path="/front")  # fmt: skip
    assert ev["stockade"]["decision"] == "denied"
    assert ev["http"]["response"]["status_code"] == 403


@pytest.mark.parametrize("mode", ["h1", "h2"])
def test_a_later_request_on_the_same_connection_is_held_to_the_sni(
    fgw: GatewayHarness, fns: ClientNamespace, fake_internet: FakeInternet, mode: str
) -> None:
    """The first request names echo.test and passes; the second, on the same TLS
    connection (HTTP/1.1 keep-alive / a second HTTP/2 stream), names other.test."""
    (s1, d1, b1), (s2, d2, b2) = two_requests(fns, fake_internet, fgw, mode, "other.test")
    assert s1 == 200 and d1 is None and json.loads(b1)["path"] == "/first/path"
    assert s2 == 403 and d2 == "destination_mismatch"
    assert json.loads(b2)["reason"] == "destination_mismatch"
    version = "HTTP/1.1" if mode == "h1" else "HTTP/2.0"
    first = find_event(fgw, "request_decision", labels__task_id="t-front",
                       url__path="/first/path", http__version=version)  # fmt: skip
    second = find_event(fgw, "request_decision", labels__task_id="t-front",
                        url__path="/second/path", stockade__request_host="other.test")  # fmt: skip
    assert first["stockade"]["connection_id"] == second["stockade"]["connection_id"]
    assert first["stockade"]["decision"] == "allowed"
    assert second["stockade"]["decision"] == "denied"


def test_both_requests_pass_when_both_name_the_sni(
    fgw: GatewayHarness, fns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    for mode in ("h1", "h2"):
        answers = two_requests(fns, fake_internet, fgw, mode, "echo.test")
        assert [a[0] for a in answers] == [200, 200], answers
        assert json.loads(answers[1][2])["path"] == "/second/path"


def test_without_the_field_the_entry_is_spliced_and_host_is_not_seen(
    fgw: GatewayHarness, fns: ClientNamespace, fake_internet: FakeInternet, tmp_path: Path
) -> None:
    """The old behaviour, kept for entries that do not ask for the check: the upstream's
    own certificate (no interception), and a Host naming another site reaches the
    allowed server under that name. On a shared front-end that routes by Host, this is
    domain fronting; `stockade rules lint` warns about such entries."""
    fi = fake_internet
    r = fns.run(
        ["curl", "-sS", "--max-time", "15", "--cacert", fi.ca_pem,
         *fi.resolve_args("allowed.test"), "-H", "Host: other.test",
         "https://allowed.test/echo"],
        capture_output=True, text=True, timeout=40,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["host"] == "allowed.test" and doc["headers"]["Host"] == "other.test"
    ev = find_event(fgw, "connection_decision", labels__task_id="t-front",
                    destination__domain="allowed.test")  # fmt: skip
    assert ev["event"]["reason"] == "allowed_by_rule"
    assert ev["rule"]["id"] == "allowed-spliced"


def test_the_lint_flags_the_spliced_entry_when_its_name_is_a_shared_frontend(
    fgw: GatewayHarness, tmp_path: Path
) -> None:
    """The same rules with a catalogue that names both hosts as a shared front-end: only
    the spliced entry is flagged (the checked one is inspected)."""
    rules = Path(fgw.config.rules_dir)
    copy = tmp_path / "rules"
    (copy / "profiles").mkdir(parents=True)
    (copy / "catalogues").mkdir()
    (copy / "profiles" / "front.yaml").write_text((rules / "profiles" / "front.yaml").read_text())
    (copy / "catalogues" / "cdn.yaml").write_text(
        "catalogue: cdn\nfrontends:\n  - {provider: fake, source: 'https://cdn.test/ips',"
        " checked: 2026-11-30, hosts: [echo.test, allowed.test]}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "stockade", "rules", "lint", "--strict", str(copy)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "'allowed-spliced' reaches the shared front-end allowed.test" in r.stdout
    assert "echo-front" not in r.stdout
