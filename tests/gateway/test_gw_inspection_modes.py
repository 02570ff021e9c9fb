"""Entries with an `http:` block outside the inspector's usual path: report mode while the
inspector is disabled, and plain HTTP (decided by the gateway on its first request head)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gw_harness import GatewayHarness, registered_client
from polling import wait_until
from stockade.gateway.sniff_http import RequestHead, body_length, parse_head
from test_gw_inspection import curl, find_event, l7_config, split, wait_ready

from stockade.testing.testnet import ClientNamespace, FakeInternet

pytestmark = pytest.mark.netns


# -- report mode never skips the inspector ---------------------------------------------------------


@pytest.fixture(scope="module")
def offgw(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHarness]:
    cfg = l7_config(tmp_path_factory.mktemp("off"), fake_internet, enabled=False)
    h = GatewayHarness(cfg).start()
    try:
        assert h.svc.inspector is None  # type: ignore[union-attr]
        yield h
    finally:
        h.stop()


@pytest.mark.parametrize("proxy", [False, True])
def test_report_mode_does_not_dial_an_inspected_entry_directly_when_inspection_is_off(
    offgw: GatewayHarness, fake_internet: FakeInternet, proxy: bool
) -> None:
    """A report-mode profile's TLS flow to an `http:` entry would have gone straight out
    (decide said allowed/report_only, inspection_unavailable), skipping the Host/SNI
    checks inside TLS: it is denied, in report mode too."""
    task = f"t-off{int(proxy)}"
    with registered_client(offgw, task, "l7watch", "l7") as ns:
        args = ["curl", "-sS", "--max-time", "15", "--cacert", fake_internet.ca_pem]
        if proxy:
            args += ["--proxy", f"http://{ns.host_ip}:{offgw.port('proxy')}"]
        else:
            args += fake_internet.resolve_args("echo.test")
        r = ns.run(
            [*args, "https://echo.test/allowed/x"], capture_output=True, text=True, timeout=40
        )
        assert r.returncode != 0 and '"host": "echo.test"' not in r.stdout, r.stdout
        ev = find_event(offgw, "connection_decision", labels__task_id=task)
        assert ev["event"]["reason"] == "inspection_unavailable"
        assert ev["stockade"]["decision"] == "denied"
        assert not ev["stockade"].get("report_only")
        assert "disabled" in ev["message"]


# -- plain HTTP: one decided request per connection ------------------------------------------------

ECHO_PORT = 8087
PLAIN = f"""\
profile: plain
description: plain HTTP to an echoing upstream, with method/path rules
egress:
  allow:
    - host: echo.test
      ports: [{ECHO_PORT}]
      reason: an HTTP/1.1 upstream that shows what it received (it echoes every byte)
      http: {{methods: [GET, POST], paths: ["/allowed/**"]}}
"""

# a TCP echo on echo.test's address in the fake internet: what it sends back is exactly
# what the gateway forwarded
ECHO = """
import socket, sys, threading
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((sys.argv[1], int(sys.argv[2]))); ls.listen(64)
print("ready", flush=True)
def serve(c):
    with c:
        while d := c.recv(65536):
            c.sendall(d)
while True:
    threading.Thread(target=serve, args=(ls.accept()[0],), daemon=True).start()
"""


@pytest.fixture(scope="module")
def plaingw(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHarness]:
    tmp = tmp_path_factory.mktemp("plain")
    cfg = l7_config(tmp, fake_internet)
    (tmp / "rules" / "profiles" / "plain.yaml").write_text(PLAIN)
    echo = fake_internet.popen(
        [sys.executable, "-c", ECHO, fake_internet.addresses["echo.test"], str(ECHO_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    h = GatewayHarness(cfg)
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        h.start()
        wait_ready(h)
        yield h
    finally:
        if h.svc is not None:
            h.stop()
        echo.kill()
        echo.wait()


@pytest.fixture(scope="module")
def plainns(plaingw: GatewayHarness) -> Iterator[ClientNamespace]:
    with registered_client(plaingw, "t-plain", "plain", "l7") as ns:
        yield ns


# sends the payload, then reads what comes back (the echo: exactly what the upstream got)
# until the connection ends or stays quiet for 3 s
RAW = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(bytes.fromhex(sys.argv[3]))
s.settimeout(3)
out = b""
try:
    while True:
        d = s.recv(65536)
        if not d:
            break
        out += d
except OSError:
    pass
sys.stdout.write(out.hex())
"""


def _raw(ns: ClientNamespace, fi: FakeInternet, payload: bytes) -> bytes:
    r = ns.run(
        [sys.executable, "-c", RAW, fi.addresses["echo.test"], str(ECHO_PORT), payload.hex()],
        capture_output=True,
        text=True,
        timeout=40,
    )
    assert r.returncode == 0, r.stderr
    return bytes.fromhex(r.stdout.strip())


def test_a_pipelined_second_request_never_reaches_the_upstream(
    plaingw: GatewayHarness, plainns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    host = f"echo.test:{ECHO_PORT}".encode()
    first = b"POST /allowed/a HTTP/1.1\r\nHost: " + host + b"\r\nContent-Length: 5\r\n\r\nhello"
    second = b"DELETE /secret HTTP/1.1\r\nHost: " + host + b"\r\nContent-Length: 0\r\n\r\n"
    got = _raw(plainns, fake_internet, first + second + b"GET /more HTTP/1.1\r\n\r\n")
    assert got.startswith(b"POST /allowed/a HTTP/1.1\r\n"), got
    assert got.endswith(b"Connection: close\r\n\r\nhello"), got  # the first body, whole
    assert b"/secret" not in got and b"/more" not in got, got
    ev = find_event(
        plaingw, "connection_decision", labels__task_id="t-plain", destination__port=ECHO_PORT
    )
    assert ev["stockade"]["decision"] == "allowed"


@pytest.mark.parametrize(
    "framing",
    [
        b"Transfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
        b"Content-Length: 5\r\nContent-Length: 6\r\n",
        b"Content-Length: +5\r\n",
    ],
)
def test_a_plain_http_body_it_cannot_count_is_refused(
    plaingw: GatewayHarness, plainns: ClientNamespace, fake_internet: FakeInternet, framing: bytes
) -> None:
    host = f"echo.test:{ECHO_PORT}".encode()
    head = b"POST /allowed/c HTTP/1.1\r\nHost: " + host + b"\r\n" + framing + b"\r\n"
    got = _raw(plainns, fake_internet, head + b"5\r\nhello\r\n0\r\n\r\n")
    assert not got.startswith(b"POST"), got  # nothing was echoed: never dialled
    ev = find_event(
        plaingw,
        "connection_decision",
        labels__task_id="t-plain",
        event__reason="protocol_unrecognised",
        destination__port=ECHO_PORT,
    )
    assert ev["stockade"]["decision"] == "denied"


def test_a_plain_http_get_with_a_body_is_refused(
    plaingw: GatewayHarness, plainns: ClientNamespace, fake_internet: FakeInternet
) -> None:
    """A body on a GET would pass a GET-only rule with an upload inside (HEAD: the same
    stage, tests/gateway/test_gw_stages.py)."""
    method = b"GET"
    host = f"echo.test:{ECHO_PORT}".encode()
    head = method + b" /allowed/g HTTP/1.1\r\nHost: " + host + b"\r\nContent-Length: 5\r\n\r\n"
    got = _raw(plainns, fake_internet, head + b"hello")
    assert b"hello" not in got and not got.startswith(method), got  # never dialled
    ev = find_event(
        plaingw,
        "connection_decision",
        labels__task_id="t-plain",
        event__reason="protocol_unrecognised",
        destination__port=ECHO_PORT,
        message=f"a {method.decode()} request with a body",
    )
    assert ev["stockade"]["decision"] == "denied"


@pytest.mark.parametrize(
    ("framing", "want"),
    [
        (b"", 0),
        (b"Content-Length: 5\r\n", 5),
        (b"Content-Length: 5\r\ncontent-length: 005\r\n", 5),
        (b"Content-Length: 5, 5\r\n", 5),
        (b"Content-Length: 5\r\nContent-Length: 6\r\n", None),
        (b"Content-Length: -1\r\n", None),
        (b"Content-Length: 0x5\r\n", None),
        (b"Transfer-Encoding: chunked\r\n", None),
        (b"Transfer-Encoding: identity\r\nContent-Length: 5\r\n", None),
    ],
)
def test_body_length(framing: bytes, want: int | None) -> None:
    head = parse_head(b"POST /x HTTP/1.1\r\nHost: a\r\n" + framing + b"\r\n")
    assert isinstance(head, RequestHead)
    assert body_length(head) == want


# -- supervision ---------------------------------------------------------------------------------


def test_the_inspector_gets_the_first_checked_address_that_accepts(
    plaingw: GatewayHarness, fake_internet: FakeInternet
) -> None:
    """echo.test resolves to an address with nothing on 443 first, then its own: the
    hand-off names the second (the inspector dials lazily and only the one address)."""
    from stockade.net.resolver import Resolution

    fi = fake_internet
    dead, live = fi.raw_echo_ip, fi.addresses["echo.test"]
    res = Resolution("echo.test", (), (dead, live), (), 300, None, time.monotonic() + 300)
    plaingw.svc.resolver._cache["echo.test"] = res  # type: ignore[union-attr]
    try:
        with registered_client(plaingw, "t-two", "l7", "l7") as ns:
            r = curl(ns, fi, plaingw, "echo.test", "https://echo.test/allowed/two")
            assert r.returncode == 0 and split(r)[0] == 200, r.stdout + r.stderr
            ev = find_event(plaingw, "connection_decision", labels__task_id="t-two")
            assert ev["event"]["reason"] == "inspected" and ev["destination"]["ip"] == live
    finally:
        plaingw.svc.resolver._cache.pop("echo.test", None)  # type: ignore[union-attr]


def test_a_hung_inspector_is_detected_killed_and_restarted(
    fake_internet: FakeInternet, tmp_path: Path
) -> None:
    cfg = l7_config(
        tmp_path, fake_internet, health_interval_s=0.3, health_timeout_s=1.0, health_failures=2
    )
    h = GatewayHarness(cfg).start()
    try:
        wait_ready(h)
        insp = h.svc.inspector  # type: ignore[union-attr]
        assert insp is not None
        pid = insp.pid
        assert pid is not None
        # a live inspector answers its probes
        wait_until(lambda: insp.probes_ok >= 3, 60, what="the health probe never succeeded")
        assert insp.hung == 0 and insp.pid == pid
        os.kill(pid, signal.SIGSTOP)  # alive, but its event loop answers nothing
        wait_until(lambda: insp.hung != 0, 60, what="the hung inspector was not detected")
        wait_ready(h)
        assert insp.pid != pid
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the hung child is gone, not left behind
        with registered_client(h, "t-hung", "l7", "l7") as ns:
            r = curl(ns, fake_internet, h, "echo.test", "https://echo.test/allowed/after")
            assert r.returncode == 0 and split(r)[0] == 200, r.stdout + r.stderr
    finally:
        h.stop()
