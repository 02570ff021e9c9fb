"""Where the launcher's API is and how to prove who we are: the Unix socket (default,
root-only, no token), or TCP with a bearer token and optionally a client certificate
(mTLS). Turned into the keyword arguments of an httpx client, sync or asyncio alike.

Without arguments the endpoint comes from the environment: `STOCKADE_LAUNCHER` (a socket
path or an `http(s)://` URL), `STOCKADE_TOKEN_FILE`; else the launcher's default socket.
"""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .errors import BadRequest, TransportError
from .wire import Call

DEFAULT_SOCKET = "/run/stockade/launcher.sock"  # launcher.control_socket's default
UDS_BASE = "http://launcher"  # any host: the socket decides where the request goes


@dataclass(frozen=True, slots=True)
class Endpoint:
    socket: str | None = None  # the launcher's Unix socket
    url: str | None = None  # http(s)://host:port of the TCP listener
    token: str | None = None  # sent as `Authorization: Bearer`
    token_file: str | None = None  # read at connect time (rotated tokens are picked up)
    ca: str | None = None  # CA bundle for an https URL (default: the system's)
    cert: str | None = None  # client certificate (PEM) for mTLS
    key: str | None = None  # its key (default: in `cert`)
    timeout: float = 30.0  # connect/read bound of the short calls (exec/files: no read bound)

    @classmethod
    def resolve(cls, target: str | None = None, **kw: Any) -> Endpoint:
        """`target`: a socket path or a URL; None: `STOCKADE_LAUNCHER`, else the default
        socket. `token_file` defaults to `STOCKADE_TOKEN_FILE` for a URL."""
        target = target or os.environ.get("STOCKADE_LAUNCHER") or DEFAULT_SOCKET
        if target.startswith(("http://", "https://")):
            if kw.get("token") is None and kw.get("token_file") is None:
                kw["token_file"] = os.environ.get("STOCKADE_TOKEN_FILE") or None
            return cls(url=target.rstrip("/"), **kw)
        if "://" in target:
            raise BadRequest(f"launcher address {target!r}: a socket path or http(s):// URL",
                             field="launcher")
        return cls(socket=target, **kw)

    def bearer(self) -> str | None:
        if self.token is not None:
            return self.token
        if self.token_file is None:
            return None
        try:
            token = Path(self.token_file).read_text().strip()
        except OSError as e:
            raise BadRequest(f"token file {self.token_file}: {e.strerror}",
                             field="token_file") from None
        if not token:
            raise BadRequest(f"token file {self.token_file} is empty", field="token_file")
        return token

    def ssl_context(self) -> ssl.SSLContext | bool:
        if self.url is None or not self.url.startswith("https://"):
            return True
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def client_kwargs(self) -> dict[str, Any]:
        """Keywords for `httpx.Client`/`AsyncClient` besides the transport."""
        headers = {"Accept": "application/json"}
        token = self.bearer()
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return {"base_url": self.url or UDS_BASE, "headers": headers,
                "timeout": self.timeout}

    def transport_kwargs(self) -> dict[str, Any]:
        """Keywords for `httpx.HTTPTransport`/`AsyncHTTPTransport`."""
        if self.socket is not None:
            return {"uds": self.socket}
        return {"verify": self.ssl_context()}

    def where(self) -> str:
        return self.socket or self.url or "?"


@contextlib.contextmanager
def mapped_errors(endpoint: Endpoint) -> Iterator[None]:
    """httpx's failures (refused, reset, timed out, a cut stream) as `TransportError`, so
    a caller catches one family: `StockadeError`."""
    try:
        yield
    except httpx.HTTPError as e:
        raise TransportError(f"launcher at {endpoint.where()}: {type(e).__name__}: {e}"
                             ) from None


def timeout_of(endpoint: Endpoint, call: Call) -> httpx.Timeout:
    # an exec or a file transfer lasts as long as the work; the session's TTL bounds it
    return httpx.Timeout(endpoint.timeout, read=None if call.long else endpoint.timeout)


def request_kwargs(call: Call) -> dict[str, Any]:
    kw: dict[str, Any] = {"params": call.params or None}
    if call.sse:
        kw["headers"] = {"Accept": "text/event-stream"}
    if call.json is not None:
        kw["json"] = call.json
    if call.content is not None:
        kw["content"] = call.content
    return kw
