"""What a denied client receives: bytes only, built here so the shell just sends them.

HTTP and explicit-proxy clients get `403` with `X-Stockade-Deny: <reason>` and a small
JSON body; TLS clients get a fatal alert, then the connection closes. Nothing here ever
includes an address the gateway resolved or any detail beyond the stable codes.
"""

from __future__ import annotations

import json

# TLS alert record: content type 21, TLS 1.2 record version, fatal(2), access_denied(49)
TLS_ALERT_ACCESS_DENIED = b"\x15\x03\x03\x00\x02\x02\x31"

_STATUS_TEXT = {403: "Forbidden", 502: "Bad Gateway"}


def http_denial(reason: str, rule: str | None, task: str | None, status: int = 403) -> bytes:
    body = json.dumps(
        {"error": "denied by stockade gateway", "reason": reason, "rule": rule, "task": task},
        separators=(",", ":"),
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_STATUS_TEXT.get(status, 'Forbidden')}\r\n"
        f"X-Stockade-Deny: {reason}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


CONNECT_ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"
