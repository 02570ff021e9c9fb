"""`stockade mcp`: the MCP server on stdio (for an agent framework that starts it) or on
streamable HTTP (`--transport http`), in front of a launcher's session API."""

from __future__ import annotations

import argparse
import ipaddress
import ssl
import sys
from pathlib import Path
from typing import Any

from stockade.clikit import add_config_args


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "mcp", help="serve sandboxes to MCP clients (stdio or streamable HTTP)",
        description="An MCP server with the tools run_code, exec, create_session, "
        "write_file, read_file, list_sessions and kill, on the launcher's session API "
        "(`stockade launcher serve`). Sessions it created are killed when it stops.")
    add_config_args(p, help_text="stockade.yaml: where the launcher's socket is "
                                 "(default: built-in)")
    p.add_argument("--launcher", metavar="SOCKET|URL",
                   help="the session API: a Unix socket path or an http(s):// URL "
                        "(default: launcher.control_socket)")
    p.add_argument("--launcher-token-file", metavar="FILE",
                   help="bearer token for a launcher URL (default: $STOCKADE_TOKEN_FILE)")
    p.add_argument("--launcher-ca", metavar="FILE",
                   help="CA bundle of an https:// launcher URL (default: the system's)")
    p.add_argument("--launcher-cert", metavar="FILE",
                   help="client certificate (PEM) for a launcher that asks for mTLS")
    p.add_argument("--launcher-key", metavar="FILE", help="its key (default: in the cert)")
    p.add_argument("--profile", help="profile of sessions whose tool call names none")
    p.add_argument("--ttl", type=int, metavar="SECONDS",
                   help="TTL of the sessions it creates (capped by the profile's limits.ttl)")
    p.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    p.add_argument("--host", default="127.0.0.1", help="HTTP: address to bind")
    p.add_argument("--port", type=int, default=8765, help="HTTP: port (path /mcp)")
    p.add_argument("--token-file", metavar="FILE",
                   help="HTTP: clients must send this bearer token (required off loopback)")
    p.set_defaults(func=_mcp)


def _fail(message: str) -> int:
    print(f"stockade mcp: {message}", file=sys.stderr)
    return 2


def _token(path: str | None) -> str | None:
    if path is None:
        return None
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _mcp(args: argparse.Namespace) -> int:
    # the arguments are checked before the heavy imports (mcp, starlette, uvicorn, httpx):
    # a refusal comes at once
    try:
        token = _token(args.token_file) if args.transport == "http" else None
    except (OSError, ValueError) as e:
        return _fail(f"--token-file: {e}")
    if args.transport == "http" and token is None and not _loopback(args.host):
        return _fail(f"--host {args.host} is not loopback: --token-file is required")
    import asyncio

    from stockade.client import AsyncClient, StockadeError

    from .server import serve

    target = args.launcher or args.config_loader(args.config, "mcp").launcher.control_socket
    try:
        client = AsyncClient(target, token_file=args.launcher_token_file, ca=args.launcher_ca,
                             cert=args.launcher_cert, key=args.launcher_key)
    except (StockadeError, OSError, ssl.SSLError) as e:  # a token, CA or cert unusable
        return _fail(f"launcher {target}: {e}")
    asyncio.run(serve(client, transport=args.transport, profile=args.profile, ttl_s=args.ttl,
                      host=args.host, port=args.port, token=token))
    return 0
