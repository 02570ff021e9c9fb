"""The control service's TCP transport for remote orchestrators: a bearer token from a
file (compared in constant time, re-read when the file changes so a rotation needs no
restart) and optional TLS with client certificates (mTLS). The Unix socket (root-only,
mode 0600) needs no token: only requests that arrived over TCP are checked.

No sandbox reaches this listener: the launcher's nft table redirects every TCP
connection a sandbox makes to the gateway (tests/launcher/test_sessions_tcp.py proves
it from inside one)."""

from __future__ import annotations

import hmac
import logging
import os
import socket
import ssl
import stat
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .spec import LauncherError

if TYPE_CHECKING:  # annotations only
    from aiohttp.typedefs import Handler

    from .settings import LauncherSettings

log = logging.getLogger("stockade.launcher.transport")


class TokenFile:
    """The bearer token in `path`, read again whenever the file is replaced or changed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._token: bytes | None = None

    def load(self) -> bytes:
        """The token; LauncherError for a missing, empty or group/world-readable file."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise LauncherError(f"control_token_file {self.path}: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise LauncherError(f"control_token_file {self.path} is readable by others "
                                    f"(mode {stat.S_IMODE(st.st_mode):o}; want 0600)")
            token = f.read(4096).strip()
        if not token:
            raise LauncherError(f"control_token_file {self.path} is empty")
        self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        self._token = token
        return token

    def current(self) -> bytes | None:
        """The token in force (None: unusable now, every request refused: fail closed)."""
        try:
            st = os.stat(self.path)
            if (st.st_ino, st.st_mtime_ns, st.st_size) != self._seen:
                self.load()
        except (OSError, LauncherError) as e:
            log.error("control token unusable, TCP requests refused: %s", e)
            self._seen, self._token = None, None
        return self._token

    def accepts(self, header: str | None) -> bool:
        token = self.current()
        if token is None or not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token)


def _over_tcp(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is None or sock.family != socket.AF_UNIX


def beneath(path: str, roots: list[str]) -> bool:
    """`path`, resolved, is one of `roots` (resolved) or below one."""
    real = os.path.realpath(path)
    for root in roots:
        r = os.path.realpath(root)
        if real == r or real.startswith(r.rstrip("/") + "/"):
            return True
    return False


def host_path_refusal(request: web.Request, roots: list[str],
                      paths: list[tuple[str, str]]) -> tuple[str, str] | None:
    """(field, detail) of the first host path (field, path) a TCP caller may not name:
    the launcher, root, binds inputs into sandboxes and writes exports, so a remote token
    would otherwise read and write any host file. None: all allowed (or the Unix socket,
    whose caller is root already)."""
    if not _over_tcp(request):
        return None
    for field, path in paths:
        if not beneath(path, roots):
            return field, (f"{field}: {path} is not under launcher.control_host_paths, "
                           "the host paths a TCP caller may name")
    return None


def auth_middleware(tokens: TokenFile) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if _over_tcp(request) and not tokens.accepts(request.headers.get("Authorization")):
            return web.json_response(
                {"error": "unauthorized", "detail": "missing or wrong bearer token"},
                status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return check


def tls_context(s: LauncherSettings) -> ssl.SSLContext | None:
    if not s.control_tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(s.control_tls_cert, s.control_tls_key)
        if s.control_tls_client_ca:
            ctx.load_verify_locations(s.control_tls_client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise LauncherError(f"launcher control TLS: {e}") from None
    return ctx


async def start_tcp(runner: web.AppRunner, s: LauncherSettings) -> web.TCPSite:
    """The TCP site of the service's runner (beside its Unix socket)."""
    assert s.control_listen is not None
    host, port = s.control_listen.rsplit(":", 1)
    site = web.TCPSite(runner, host.strip("[]"), int(port), ssl_context=tls_context(s))
    await site.start()
    return site
