"""The SDK over the launcher's TCP transport (`launcher.control_listen`) of a real stack:
HTTPS with a client certificate (mTLS) and a bearer token from a file; a missing or
wrong token, or no client certificate, is refused with the SDK's error classes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import trustme
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from sessions_stack import Stack

from stockade.client import AsyncSandbox, Client, Sandbox, TransportError, Unauthorized
from stockade.ports import free_port

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]

TOKEN = "orchestrator-token-0123456789"



def stack_settings(root: Path) -> dict[str, Any]:
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("orchestrator")
    server.cert_chain_pems[0].write_to_path(str(root / "server.pem"))
    server.private_key_pem.write_to_path(str(root / "server.key"))
    client.cert_chain_pems[0].write_to_path(str(root / "client.pem"))
    client.private_key_pem.write_to_path(str(root / "client.key"))
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    (root / "token").write_text(TOKEN + "\n")
    (root / "token").chmod(0o600)
    port = free_port()
    (root / "url").write_text(f"https://127.0.0.1:{port}")
    return {"launcher": {
        "control_listen": f"127.0.0.1:{port}", "control_token_file": str(root / "token"),
        "control_tls_cert": str(root / "server.pem"),
        "control_tls_key": str(root / "server.key"),
        "control_tls_client_ca": str(root / "ca.pem")}}


def _tls(stack: Stack, **kw: Any) -> dict[str, Any]:
    root = stack.cfg_path.parent
    return {"launcher": (root / "url").read_text(), "ca": str(root / "ca.pem"),
            "cert": str(root / "client.pem"), "key": str(root / "client.key"), **kw}


@pytest.mark.timeout(300)
def test_sync_over_mtls_with_token_file(stack: Stack):
    tok = str(stack.cfg_path.parent / "token")
    with Sandbox.create(profile="e2e", labels={"via": "tcp"},
                        **_tls(stack, token_file=tok)) as sb:
        assert sb.exec(["echo", "over tcp"]).stdout == "over tcp\n"
        sb.files.write("x.txt", "1")
        assert sb.files.read("x.txt") == b"1"
        sid = sb.id
    with Client(stack.socket) as c:  # the Unix socket sees the same session, ended
        assert c.get(sid).state == "ended" and c.get(sid).labels == {"via": "tcp"}


@pytest.mark.timeout(300)
def test_refusals_over_tcp(stack: Stack):
    kw = _tls(stack)
    url = kw.pop("launcher")
    for token in (None, "wrong-token", TOKEN + "x"):
        with Client(url, token=token, **kw) as c, pytest.raises(Unauthorized):
            c.list()
    without_cert = {k: v for k, v in kw.items() if k not in ("cert", "key")}
    with Client(url, token=TOKEN, **without_cert) as c, pytest.raises(TransportError):
        c.list()  # the TLS handshake refuses a client without a certificate


@pytest.mark.timeout(300)
async def test_async_over_mtls(stack: Stack):
    async with AsyncSandbox.create(profile="e2e", **_tls(stack, token=TOKEN)) as sb:
        res = await sb.exec(["sh", "-c", "echo a; echo b >&2"])
        assert (res.stdout, res.stderr, res.exit_code) == ("a\n", "b\n", 0)


@pytest.mark.timeout(300)
async def test_mcp_server_over_the_tcp_launcher(stack: Stack):
    """`stockade mcp --launcher https://...` with the token file and a client certificate."""
    kw = _tls(stack)
    args = ["-m", "stockade", "mcp", "--profile", "e2e", "--launcher", kw["launcher"],
            "--launcher-token-file", str(stack.cfg_path.parent / "token"),
            "--launcher-ca", kw["ca"], "--launcher-cert", kw["cert"],
            "--launcher-key", kw["key"]]
    params = StdioServerParameters(command=sys.executable, args=args)
    async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
        await s.initialize()
        res = await s.call_tool("run_code", {"code": "print('via https')"})
        assert not res.isError, res.content
        assert res.structuredContent["stdout"] == "via https\n"
