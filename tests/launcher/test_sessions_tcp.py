"""The control service over TCP: a bearer token from a file (missing, wrong, rotated),
optional mTLS, and no way in from a sandbox."""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from stockade.config import Config
from stockade.ports import free_port

from .conftest import Lab
from .sessions_rig import Rig, _config, serving

pytestmark = pytest.mark.netns


def _tcp_config(lab: Lab, tmp: Path, host: str, token_text: str, mode: int = 0o600,
                **tls: str) -> tuple[Config, int, Path]:
    token = tmp / "token"
    token.write_text(token_text)
    token.chmod(mode)
    port = free_port()
    return _config(lab, tmp, control_listen=f"{host}:{port}", control_token_file=str(token),
                   **tls), port, token


@pytest.fixture(scope="module")
def tcp(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Rig, int, Path]]:
    tmp = tmp_path_factory.mktemp("sessions-tcp")
    # every address of the host: the sandbox's host-side veth address among them
    config, port, token = _tcp_config(lab, tmp, "0.0.0.0", "first-token\n")
    with serving(lab, tmp, config) as r:
        yield r, port, token


def _call(port: int, path: str, token: str | None, method: str = "GET",
          body: Any = None, conn: http.client.HTTPConnection | None = None
          ) -> tuple[int, dict[str, Any]]:
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else {}


def test_token_required(tcp: tuple[Rig, int, Path]) -> None:
    rig, port, _ = tcp
    for token in (None, "wrong-token", "first-token-but-longer", ""):
        status, body = _call(port, "/v1/sessions", token)
        assert status == 401 and body["error"] == "unauthorized", token
    assert _call(port, "/v1/sessions", "first-token")[0] == 200
    # the Unix socket needs none (root-only)
    assert rig.api.call("GET", "/v1/sessions").status == 200


def test_rotated_token_file(tcp: tuple[Rig, int, Path]) -> None:
    _, port, token = tcp
    new = token.with_name("token.new")
    new.write_text("second-token\n")
    new.chmod(0o600)
    new.replace(token)
    try:
        assert _call(port, "/v1/sessions", "first-token")[0] == 401
        assert _call(port, "/v1/sessions", "second-token")[0] == 200
        token.unlink()  # gone: every request refused, none let through
        assert _call(port, "/v1/sessions", "second-token")[0] == 401
    finally:
        token.write_text("first-token\n")
        token.chmod(0o600)
    assert _call(port, "/v1/sessions", "first-token")[0] == 200


def test_session_over_tcp(tcp: tuple[Rig, int, Path]) -> None:
    _, port, _ = tcp
    status, s = _call(port, "/v1/sessions", "first-token", "POST", {"profile": "svc"})
    assert status == 201, s
    try:
        status, r = _call(port, f"/v1/sessions/{s['session_id']}/exec", "first-token", "POST",
                          {"argv": ["echo", "remote"], "stream": False})
        assert status == 200 and r["stdout"] == "remote\n"
    finally:
        _call(port, f"/v1/sessions/{s['session_id']}", "first-token", "DELETE")


def test_sandbox_cannot_reach_the_api(tcp: tuple[Rig, int, Path], lab: Lab) -> None:
    """From inside a session: the control port on the host-side address and on loopback.
    The nft table redirects the first to the gateway (the lab's stand-in answers GW), the
    second is the sandbox's own loopback; the service is never reached."""
    rig, port, _ = tcp
    sid = rig.api.create("svc")["session_id"]
    try:
        host_ip = rig.svc.launcher._live[sid].record.host_ip
        probe = ("import socket, sys\n"
                 "for host in sys.argv[1:]:\n"
                 "    try:\n"
                 f"        c = socket.create_connection((host, {port}), timeout=3)\n"
                 "        c.sendall(b'GET /v1/sessions HTTP/1.0\\r\\n\\r\\n')\n"
                 "        print(host, repr(c.recv(100)))\n"
                 "    except OSError as e:\n"
                 "        print(host, 'refused', type(e).__name__)\n")
        r = rig.api.exec(sid, ["python3", "-c", probe, host_ip, "127.0.0.1"])
        lines = r["stdout"].splitlines()
        assert "HTTP/" not in r["stdout"], r
        assert lines[0].endswith("b'GW\\n'"), r  # the gateway stand-in got it, not the API
        assert "refused" in lines[1], r
        assert any(dst == host_ip and p == port for _peer, dst, p in lab.obs.tcp)
    finally:
        rig.api.kill(sid)


def test_mtls(lab: Lab, tmp_path: Path) -> None:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("orchestrator")
    paths = {n: tmp_path / f"{n}.pem" for n in ("cert", "key", "ca", "client")}
    server.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(paths["client"]))
    config, port, _ = _tcp_config(lab, tmp_path, "127.0.0.1", "t0k\n",
                                  control_tls_cert=str(paths["cert"]),
                                  control_tls_key=str(paths["key"]),
                                  control_tls_client_ca=str(paths["ca"]))
    with serving(lab, tmp_path, config):
        ctx = ssl.create_default_context(cafile=str(paths["ca"]))
        ctx.load_cert_chain(str(paths["client"]))
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
        assert _call(port, "/v1/sessions", "t0k", conn=conn)[0] == 200
        bare = ssl.create_default_context(cafile=str(paths["ca"]))  # no client certificate
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            _call(port, "/v1/sessions", "t0k",
                  conn=http.client.HTTPSConnection("127.0.0.1", port, context=bare,
                                                   timeout=30))


def test_unusable_token_file_refuses_to_start(lab: Lab, tmp_path: Path) -> None:
    config, _, _ = _tcp_config(lab, tmp_path, "127.0.0.1", "t\n", mode=0o644)
    with pytest.raises(RuntimeError, match="readable by others"), serving(lab, tmp_path, config):
        pass


def test_a_tcp_caller_names_no_host_path(tcp: tuple[Rig, int, Path], tmp_path: Path) -> None:
    """The launcher (root) binds inputs and writes exports where the request says: over
    TCP a token was a read of /etc/shadow (an input) and a root-owned file of the
    sandbox's choosing in /etc/cron.d (an export_dir). With control_host_paths empty (as
    here) a TCP request naming any host path is refused before a sandbox exists; the
    Unix socket (root's) still may."""
    rig, port, _ = tcp
    before = {s["session_id"] for s in rig.api.call("GET", "/v1/sessions").json()["sessions"]}
    status, body = _call(port, "/v1/sessions", "first-token", "POST",
                         {"profile": "svc", "inputs": [{"host": "/etc/shadow",
                                                        "guest": "/in/s"}]})
    assert (status, body["error"], body["field"]) == (400, "bad_request", "inputs.0.host")
    status, body = _call(port, "/v1/sandboxes", "first-token", "POST",
                         {"profile": "svc", "argv": ["true"], "export_dir": "/etc/cron.d"})
    assert (status, body["field"]) == (400, "export_dir")
    status, body = _call(port, "/v1/sandboxes", "first-token", "POST",
                         {"profile": "svc", "argv": ["true"], "inputs": ["/etc/shadow"]})
    assert (status, body["field"]) == (400, "inputs[0]")
    after = {s["session_id"] for s in rig.api.call("GET", "/v1/sessions").json()["sessions"]}
    assert after == before
    (tmp_path / "in.txt").write_text("mine")
    s = rig.api.create("svc", inputs=[{"host": str(tmp_path / "in.txt"), "guest": "/in/t"}])
    try:
        assert rig.api.exec(s["session_id"], ["cat", "/in/t"])["stdout"] == "mine"
    finally:
        rig.api.kill(s["session_id"])


def test_control_host_paths_are_resolved(tmp_path: Path) -> None:
    """A path is allowed only if it resolves beneath a root: a symlink under the root
    that points out, a sibling that shares the root's prefix, `..` out: all refused."""
    from stockade.launcher.transport import beneath

    root = tmp_path / "shared"
    (root / "sub").mkdir(parents=True)
    (root / "out").symlink_to("/etc")
    (tmp_path / "shared-not").mkdir()
    assert beneath(str(root), [str(root)]) and beneath(str(root / "sub"), [str(root) + "/"])
    assert beneath(str(root / "sub" / "new-export-dir"), [str(root)])
    for bad in (root / "out" / "shadow", tmp_path / "shared-not", root / ".." / "x"):
        assert not beneath(str(bad), [str(root)]), bad
    assert not beneath(str(root / "sub"), [])
