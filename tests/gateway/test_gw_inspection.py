"""L7 inspection of TLS flows, end to end: a real gateway with its real inspector child
(mitmproxy), a client namespace whose TCP nftables redirects to the gateway, and the fake
internet's servers behind it. Clients are curl, Python ssl and pip; they trust the
gateway's inspection CA, the inspector trusts the fake internet's CA upstream."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_client import read_head
from gw_config import UNTHROTTLED
from gw_harness import (
    GatewayHarness,
    gateway_config,
    pip_download,
    registered_client,
    running_gateway,
    wait_ready,
)
from gw_harness import newest_event as find_event
from polling import wait_until
from stockade.gateway.inspector.handoff import FlowMeta, connect_request

from stockade.testing.testnet import ClientNamespace, FakeInternet

pytestmark = pytest.mark.netns

L7 = """\
profile: l7
description: inspected echo and a pypi-style index
egress:
  presets: [pypi-test-readonly]
  allow:
    - host: echo.test
      reason: inspected echo
      http: {methods: [GET, HEAD], paths: ["/allowed/**", "/ok"]}
    - host: allowed.test
      ports: [443, 80]
      reason: uninspected
"""

L7_WATCH = """\
profile: l7watch
description: report mode over an inspected entry
egress:
  mode: report
  allow:
    - host: echo.test
      reason: inspected echo
      http: {methods: [GET], paths: ["/allowed/**"]}
"""

PRESET = """\
preset: pypi-test-readonly
description: the fake internet's PEP 503 index, read-only (like pypi-readonly)
allow:
  - host: pypi.test
    id: pypi-test-index
    reason: index pages and the files it links to
    http:
      methods: [GET, HEAD]
      paths: ["/simple/**", "/packages/**"]
"""


def write_l7_rules(root: Path) -> Path:
    (root / "profiles").mkdir(parents=True, exist_ok=True)
    (root / "presets").mkdir(parents=True, exist_ok=True)
    (root / "profiles" / "l7.yaml").write_text(L7)
    (root / "profiles" / "l7watch.yaml").write_text(L7_WATCH)
    (root / "presets" / "pypi-test-readonly.yaml").write_text(PRESET)
    return root


def l7_config(
    tmp: Path, fi: FakeInternet, events: dict[str, Any] | None = UNTHROTTLED, **inspection: Any
) -> Path:
    rules = write_l7_rules(tmp / "rules")
    return gateway_config(
        tmp,
        fi,
        rules,
        events=events,
        sniff_timeout_s=3.0,
        dns={"ttl_min_s": 0},
        inspection={"upstream_ca_file": fi.ca_pem, "restart_delay_s": 1.0, **inspection},
    )


@pytest.fixture(scope="module")
def l7gw(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHarness]:
    with running_gateway(l7_config(tmp_path_factory.mktemp("l7gw"), fake_internet),
                         inspector=True) as h:
        yield h


@pytest.fixture(scope="module")
def l7ns(l7gw: GatewayHarness) -> Iterator[ClientNamespace]:
    with registered_client(l7gw, "t-l7", "l7", "l7") as ns:
        yield ns


def ca(gw: GatewayHarness) -> str:
    insp = gw.svc.inspector  # type: ignore[union-attr]
    assert insp is not None and insp.ca_cert
    return insp.ca_cert


def curl(
    ns: ClientNamespace, fi: FakeInternet, gw: GatewayHarness, name: str, *args: str, ip: str = ""
) -> subprocess.CompletedProcess[str]:
    """curl in the namespace, trusting only the Stockade CA; `name` resolves to `ip`
    (default: its own fake address) through --resolve, so the client picks the address."""
    pin = f"{name}:443:{ip or fi.addresses[name]}"
    return ns.run(
        ["curl", "-sS", "-i", "--max-time", "15", "--cacert", ca(gw), "--resolve", pin, *args],
        capture_output=True,
        text=True,
        timeout=40,
    )


def split(r: subprocess.CompletedProcess[str]) -> tuple[int, dict[str, str], str]:
    """Status, headers (lower-case names) and body of curl -i's last response."""
    text = r.stdout.replace("\r\n", "\n")
    head, _, body = text.partition("\n\n")
    lines = head.split("\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


def requests_of(gw: GatewayHarness, connection_id: int) -> list[dict[str, Any]]:
    return [
        e
        for e in gw.events()
        if e["event"]["action"] == "request_decision"
        and e["stockade"].get("connection_id") == connection_id
    ]


# -- allowed, denied, fronting -----------------------------------------------------------------


def test_allowed_get_is_inspected_and_dialled_at_the_checked_address(
    l7gw: GatewayHarness, l7ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    """The client points echo.test at denied.test's address; the gateway resolves echo.test
    itself and the inspector dials that checked address: echo.test answers."""
    fi = fake_internet
    spoofed = fi.addresses["denied.test"]
    r = curl(l7ns, fi, l7gw, "echo.test", "https://echo.test/allowed/x?q=1", ip=spoofed)
    assert r.returncode == 0, r.stderr
    status, _, body = split(r)
    assert status == 200
    doc = json.loads(body)
    assert doc["host"] == "echo.test" and doc["path"] == "/allowed/x"
    assert not any(k.lower().startswith("stockade") for k in doc["headers"])
    conn_ev = find_event(
        l7gw,
        "connection_decision",
        labels__task_id="t-l7",
        stockade__original_destination=f"{spoofed}:443",
    )
    assert conn_ev["event"]["reason"] == "inspected"
    assert conn_ev["destination"]["ip"] == fi.addresses["echo.test"]
    req = find_event(
        l7gw,
        "request_decision",
        stockade__connection_id=conn_ev["stockade"]["connection_id"],
    )
    assert req["stockade"]["decision"] == "allowed"
    assert req["event"]["reason"] == "allowed_by_rule"
    assert req["http"]["request"]["method"] == "GET"
    assert req["url"]["path"] == "/allowed/x"
    assert req["destination"]["ip"] == fi.addresses["echo.test"]
    assert req["rule"]["ruleset"] == l7gw.svc.rules.current.version  # type: ignore[union-attr]


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_post_and_other_paths_get_403_with_the_reason(
    l7gw: GatewayHarness, l7ns: ClientNamespace, fake_internet: FakeInternet, http: str
) -> None:
    for args, reason in (
        (["-X", "POST", "--data", "x=1", "https://echo.test/allowed/x"], "method_not_allowed"),
        (["https://echo.test/elsewhere"], "path_not_allowed"),
    ):
        r = curl(l7ns, fake_internet, l7gw, "echo.test", http, *args)
        assert r.returncode == 0, r.stderr
        status, headers, body = split(r)
        assert status == 403, r.stdout
        assert headers["x-stockade-deny"] == reason
        doc = json.loads(body)
        assert set(doc) == {"error", "reason", "rule", "task"}
        assert doc["reason"] == reason and doc["task"] == "t-l7"
        assert fake_internet.addresses["echo.test"] not in r.stdout
        ev = find_event(l7gw, "request_decision", event__reason=reason, labels__task_id="t-l7")
        assert ev["stockade"]["decision"] == "denied"
        assert ev["http"]["response"]["status_code"] == 403


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_host_header_naming_another_host_inside_tls_is_refused(
    l7gw: GatewayHarness, l7ns: ClientNamespace, fake_internet: FakeInternet, http: str
) -> None:
    """Domain fronting inside the tunnel: SNI echo.test, Host (HTTP/2: :authority)
    allowed.test, which the profile allows without inspection."""
    r = curl(
        l7ns,
        fake_internet,
        l7gw,
        "echo.test",
        http,
        "-H",
        "Host: allowed.test",
        "https://echo.test/allowed/x",
    )
    status, headers, _ = split(r)
    assert status == 403 and headers["x-stockade-deny"] == "destination_mismatch", r.stdout
    ev = find_event(
        l7gw, "request_decision", event__reason="destination_mismatch", labels__task_id="t-l7"
    )
    assert ev["stockade"]["request_host"] == "allowed.test"


def test_upgrade_inside_the_tunnel_is_refused(
    l7gw: GatewayHarness, l7ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    r = curl(
        l7ns,
        fake_internet,
        l7gw,
        "echo.test",
        "--http1.1",
        "-H",
        "Connection: Upgrade",
        "-H",
        "Upgrade: websocket",
        "https://echo.test/allowed/ws",
    )
    status, headers, _ = split(r)
    assert status == 403 and headers["x-stockade-deny"] == "protocol_unrecognised", r.stdout


RAW_TLS = """
import socket, ssl, sys
ip, sni, ca, payload = sys.argv[1], sys.argv[2], sys.argv[3], bytes.fromhex(sys.argv[4])
ctx = ssl.create_default_context(cafile=ca)
s = ctx.wrap_socket(socket.create_connection((ip, 443), timeout=10), server_hostname=sni)
s.sendall(payload)
out = b""
try:
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        out += chunk
except (ssl.SSLError, OSError) as e:
    out += repr(e).encode()
print(out.decode("latin-1"))
"""


def test_non_http_bytes_inside_the_tunnel_are_refused(
    l7gw: GatewayHarness, l7ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    payload = b"\x00\x01binary-not-http\xff\xfe" * 4
    r = l7ns.run(
        [
            sys.executable,
            "-c",
            RAW_TLS,
            fake_internet.addresses["echo.test"],
            "echo.test",
            ca(l7gw),
            payload.hex(),
        ],
        capture_output=True,
        text=True,
        timeout=40,
    )
    assert r.returncode == 0, r.stderr
    assert "echo.test" not in r.stdout and "HTTP/" not in r.stdout
    ev = find_event(
        l7gw,
        "request_decision",
        event__reason="protocol_unrecognised",
        network__protocol="tls",
        labels__task_id="t-l7",
    )
    assert ev["stockade"]["decision"] == "denied"


# -- flows that do not need inspection never reach the inspector --------------------------------


def test_flows_without_http_blocks_are_not_routed_through_the_inspector(
    l7gw: GatewayHarness, l7ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    insp = l7gw.svc.inspector  # type: ignore[union-attr]
    assert insp is not None
    before = insp.attempts
    r = l7ns.run(
        [
            "curl",
            "-sS",
            "--max-time",
            "15",
            "--cacert",
            fake_internet.ca_pem,  # the upstream's own certificate: no interception
            *fake_internet.resolve_args("allowed.test"),
            "https://allowed.test/",
        ],
        capture_output=True,
        text=True,
        timeout=40,
    )
    assert r.returncode == 0 and "Hello from allowed.test" in r.stdout, r.stderr
    ev = find_event(
        l7gw, "connection_decision", labels__task_id="t-l7", destination__domain="allowed.test"
    )
    assert ev["event"]["reason"] == "allowed_by_rule"
    assert insp.attempts == before  # not even tried
    # a barrier instead of a sleep: the inspector writes its events in order, so once an
    # inspected request made after this flow has its event, a stray one would be there
    r = curl(l7ns, fake_internet, l7gw, "echo.test", "https://echo.test/allowed/barrier")
    assert r.returncode == 0, r.stderr
    find_event(l7gw, "request_decision", labels__task_id="t-l7", url__path="/allowed/barrier")
    assert requests_of(l7gw, ev["stockade"]["connection_id"]) == []


# -- report mode -------------------------------------------------------------------------------


def test_report_mode_lets_the_request_through_and_says_it_would_deny(
    l7gw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    with registered_client(l7gw, "t-l7watch", "l7watch", "l7") as ns:
        r = curl(
            ns, fake_internet, l7gw, "echo.test", "-X", "POST", "--data", "a=b",
            "https://echo.test/elsewhere",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        status, _, body = split(r)
        assert status == 200 and json.loads(body)["method"] == "POST"
        ev = find_event(l7gw, "request_decision", labels__task_id="t-l7watch")
        assert ev["stockade"]["decision"] == "allowed"
        assert ev["stockade"]["report_only"] is True
        assert ev["event"]["reason"] == "method_not_allowed"


# -- pip through an inspected pypi-style preset --------------------------------------------------


def test_pip_download_through_an_inspected_index(
    l7gw: GatewayHarness, l7ns: ClientNamespace, fake_internet: FakeInternet, tmp_path: Path
) -> None:
    before = len(l7gw.events())
    r = pip_download(
        l7ns, tmp_path, f"http://{l7ns.host_ip}:{l7gw.port('proxy')}",
        env={"PIP_CERT": ca(l7gw)},  # what the launcher sets in a sandbox
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert any(p.suffix == ".whl" for p in tmp_path.iterdir())
    find_event(l7gw, "request_decision", labels__task_id="t-l7", url__domain="pypi.test")
    reqs = [
        e
        for e in l7gw.events()[before:]
        if e["event"]["action"] == "request_decision"
        and e.get("url", {}).get("domain") == "pypi.test"
    ]
    paths = {e["url"]["path"].split("/")[1] for e in reqs}
    assert paths == {"simple", "packages"}
    assert all(e["stockade"]["decision"] == "allowed" for e in reqs)
    assert all(e["rule"]["id"] == "pypi-test-index" for e in reqs)
    assert all(e["stockade"]["listener"] == "proxy" for e in reqs)


# -- supervision ---------------------------------------------------------------------------------


def test_inspector_killed_fails_closed_then_restarts(
    l7gw: GatewayHarness, l7ns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    insp = l7gw.svc.inspector  # type: ignore[union-attr]
    assert insp is not None
    for _attempt in range(3):
        pid = insp.pid
        assert pid is not None and insp.ready
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda old=pid: not (insp.ready and insp.pid == old), 30, 0.005)
        r = curl(l7ns, fake_internet, l7gw, "echo.test", "https://echo.test/allowed/down")
        if insp.ready:  # restarted before the request came: try again
            wait_ready(l7gw)
            continue
        assert r.returncode != 0 or "HTTP/" not in r.stdout, r.stdout
        ev = find_event(
            l7gw,
            "connection_decision",
            labels__task_id="t-l7",
            event__reason="inspection_unavailable",
            destination__domain="echo.test",
        )
        assert ev["stockade"]["decision"] == "denied"
        assert "inspector" in ev["message"]
        break
    else:
        pytest.fail("the inspector always restarted before a request could be made")
    wait_ready(l7gw)
    assert insp.pid != pid
    r = curl(l7ns, fake_internet, l7gw, "echo.test", "https://echo.test/allowed/up")
    assert r.returncode == 0 and split(r)[0] == 200, r.stdout + r.stderr


# -- the CA ----------------------------------------------------------------------------------------


def test_ca_is_made_once_and_persists_across_gateway_restarts(
    fake_internet: FakeInternet, tmp_path: Path
) -> None:
    cfg = l7_config(tmp_path, fake_internet)
    first = GatewayHarness(cfg).start()
    try:
        cert = Path(ca(first))
        pem = cert.read_bytes()
        key = cert.with_name("mitmproxy-ca.pem")
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert b"PRIVATE KEY" not in pem
    finally:
        first.stop()
    second = GatewayHarness(cfg).start()
    try:
        assert Path(ca(second)) == cert and cert.read_bytes() == pem
        wait_ready(second)
    finally:
        second.stop()
    out = subprocess.run(
        [sys.executable, "-m", "stockade", "gateway", "ca", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(cert)


# -- the inspector's own checks, driven directly (as a local process could) ------------------------


def _inspector_port(gw: GatewayHarness) -> int:
    insp = gw.svc.inspector  # type: ignore[union-attr]
    assert insp is not None and insp.port is not None
    return int(insp.port)


def _handoff(gw: GatewayHarness, request: bytes) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", _inspector_port(gw)), timeout=10)
    sock.sendall(request)
    return sock, read_head(sock)


def _meta(gw: GatewayHarness, fi: FakeInternet, **kw: Any) -> FlowMeta:
    base: dict[str, Any] = {
        "connection_id": 900_000 + secrets.randbelow(1000),
        "task_id": "t-direct",
        "profile": "l7",
        "host": "echo.test",
        "ip": fi.addresses["echo.test"],
        "port": 443,
        "policy_version": gw.svc.rules.current.version,  # type: ignore[union-attr]
    }
    base.update(kw)
    return FlowMeta(**base)


def test_a_handoff_without_the_gateways_key_is_refused(
    l7gw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    m = _meta(l7gw, fake_internet)
    other_target = fake_internet.addresses["denied.test"]
    for request in (
        f"CONNECT {m.authority} HTTP/1.1\r\nHost: {m.authority}\r\n\r\n".encode(),
        connect_request(m, b"not the key"),
        # signed by the real key, but for another address than the CONNECT names
        connect_request(m, l7gw.svc.inspector.key).replace(  # type: ignore[union-attr]
            m.authority.encode(), f"{other_target}:443".encode()
        ),
        # a plain proxy request: never forwarded
        b"GET http://echo.test/allowed/x HTTP/1.1\r\nHost: echo.test\r\n\r\n",
    ):
        sock, head = _handoff(l7gw, request)
        sock.close()
        if request.startswith(b"CONNECT"):
            assert head.startswith(b"HTTP/1.1 403"), head
        else:
            assert not head.startswith(b"HTTP/1.1 2") and b"echo.test" not in head, head


def _tls_through(
    gw: GatewayHarness, m: FlowMeta, sni: str | None, payload: bytes
) -> tuple[bytes, str]:
    sock, head = _handoff(gw, connect_request(m, gw.svc.inspector.key))  # type: ignore[union-attr]
    assert head.startswith(b"HTTP/1.1 200"), head
    ctx = ssl.create_default_context(cafile=ca(gw))
    if sni is None:
        ctx.check_hostname = False
    try:
        tls = ctx.wrap_socket(sock, server_hostname=sni)
    except (ssl.SSLError, OSError) as e:
        sock.close()
        return b"", type(e).__name__
    try:
        tls.sendall(payload)
        out = b""
        while True:
            chunk = tls.recv(65536)
            if not chunk:
                break
            out += chunk
        return out, ""
    except (ssl.SSLError, OSError) as e:
        return b"", type(e).__name__
    finally:
        tls.close()


def test_the_inspector_refuses_a_missing_or_other_sni(
    l7gw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    get = b"GET /allowed/x HTTP/1.1\r\nHost: echo.test\r\nConnection: close\r\n\r\n"
    for sni, reason in ((None, "sni_missing"), ("other.test", "destination_mismatch")):
        m = _meta(l7gw, fake_internet)
        out, err = _tls_through(l7gw, m, sni, get)
        assert out == b"" and err, (out, err)
        ev = find_event(l7gw, "request_decision", stockade__connection_id=m.connection_id)
        assert ev["event"]["reason"] == reason and ev["stockade"]["decision"] == "denied"
    # the same hand-off with the right SNI is served: the refusals above were the SNI's
    m = _meta(l7gw, fake_internet)
    out, err = _tls_through(l7gw, m, "echo.test", get)
    assert out.startswith(b"HTTP/1.1 200"), (out[:200], err)


def test_connect_inside_the_tunnel_is_not_served(
    l7gw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    m = _meta(l7gw, fake_internet)
    out, _ = _tls_through(
        l7gw, m, "echo.test", b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    )
    # mitmproxy's validation (400) or the addon's http_connect (403), Stockade's body either way
    assert out.startswith((b"HTTP/1.1 400", b"HTTP/1.1 403")), out[:200]
    assert b"protocol_unrecognised" in out and b"allowed.test" not in out.split(b"\r\n\r\n")[0]
    ev = find_event(l7gw, "request_decision", stockade__connection_id=m.connection_id)
    assert ev["stockade"]["decision"] == "denied"
    assert ev["event"]["reason"] == "protocol_unrecognised"
    assert ev["http"]["request"]["method"] == "CONNECT"


def test_a_stale_policy_version_is_denied(
    l7gw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    m = _meta(l7gw, fake_internet, policy_version="0123456789abcdef")
    get = b"GET /allowed/x HTTP/1.1\r\nHost: echo.test\r\nConnection: close\r\n\r\n"
    out, _ = _tls_through(l7gw, m, "echo.test", get)
    assert out.startswith(b"HTTP/1.1 403") and b"inspection_unavailable" in out, out[:300]


def test_upstream_failures_never_show_the_sandbox_an_address(
    l7gw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    """The inspector verifies the upstream's certificate against the flow's host (here it
    dials denied.test's server, whose certificate does not name echo.test), and a refused
    connection or a failed verification ends the flow without mitmproxy's error page
    (which names the address it dialled)."""
    get = b"GET /allowed/x HTTP/1.1\r\nHost: echo.test\r\nConnection: close\r\n\r\n"
    wrong_cert = _meta(l7gw, fake_internet, ip=fake_internet.addresses["denied.test"])
    refused = _meta(l7gw, fake_internet, ip=fake_internet.raw_echo_ip)  # nothing on 443
    for m in (wrong_cert, refused):
        out, _ = _tls_through(l7gw, m, "echo.test", get)
        assert out == b"", out[:300]


def test_a_denied_upload_is_answered_without_reading_its_body(
    l7gw: GatewayHarness, l7ns: ClientNamespace, fake_internet: FakeInternet, tmp_path: Path
) -> None:
    """A denied request with a body gets its 403 at once, and the connection ends (the
    body is never read: see test_gw_inspection_smuggling for the memory check)."""
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * (256 * 1024))
    r = curl(
        l7ns, fake_internet, l7gw, "echo.test", "--http1.1", "-X", "PUT",
        "--data-binary", f"@{big}", "https://echo.test/allowed/upload",
    )  # fmt: skip
    # curl may see the 403 or, when the close reaches it first, a send error
    if "HTTP/" in r.stdout:
        status, headers, _ = split(r)
        assert status == 403 and headers["x-stockade-deny"] == "method_not_allowed"
    else:
        assert r.returncode != 0
    ev = find_event(
        l7gw,
        "request_decision",
        labels__task_id="t-l7",
        http__request__method="PUT",
        url__path="/allowed/upload",
    )
    assert ev["stockade"]["decision"] == "denied"
    assert ev["event"]["reason"] == "method_not_allowed"


def test_health_reports_the_inspector(l7gw: GatewayHarness) -> None:
    health = l7gw.control.health()
    insp = l7gw.svc.inspector  # type: ignore[union-attr]
    assert insp is not None
    assert health["inspector"] == {"ready": True, "pid": insp.pid}
