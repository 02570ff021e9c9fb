"""The fence self-test's shell: runs the probes of launcher/selftest.py from inside a
sandbox's network namespace and reports what each saw.

One short-lived thread enters the namespace (setns(2) changes only the calling thread)
and creates every probe's socket there: a socket stays in the namespace it was made in,
so the probes then run in a small thread pool of the launcher's own namespace, all at
once, each under its own deadline. Outcomes are the vocabulary of
`selftest.Observation`.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dns.exception
import dns.message
import dns.rcode

from .guest_probes import http_verdict
from .netns import NETNS_DIR
from .selftest import Observation, Probe

CLONE_NEWNET = 0x40000000
UDP_WINDOW_S = 0.01  # how long the UDP probe listens for an answer
_UNREACHABLE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL}
_REFUSED = {errno.ECONNREFUSED, errno.EACCES, errno.EPERM}


class ProbeSetupError(RuntimeError):
    """The namespace could not be entered or a socket not made there."""


def _socket_for(p: Probe) -> socket.socket:
    family = socket.AF_INET6 if p.kind == "tcp6" else socket.AF_INET
    kind = socket.SOCK_DGRAM if p.kind in ("dns", "udp") else socket.SOCK_STREAM
    return socket.socket(family, kind)


def sockets_in(netns: str, probes: list[Probe]) -> list[socket.socket]:
    """One socket per probe, made inside `netns` (by a thread that setns(2)s there)."""
    box: dict[str, Any] = {}

    def enter() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            box["socks"] = [_socket_for(p) for p in probes]
        except OSError as e:
            box["error"] = e

    t = threading.Thread(target=enter, name="stockade-probe-netns", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise ProbeSetupError(f"cannot make probe sockets in netns {netns}: {box['error']}")
    return list(box["socks"])


def _os_outcome(e: OSError) -> str:
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, ConnectionResetError):
        return "reset"
    if isinstance(e, ssl.SSLError):
        return "closed"  # an alert or an EOF: the handshake was refused
    if e.errno in _UNREACHABLE:
        return "unreachable"
    if e.errno in _REFUSED:
        return "refused"
    return f"error:{errno.errorcode.get(e.errno or 0, type(e).__name__)}"


def _port(s: socket.socket) -> int | None:
    try:
        return int(s.getsockname()[1]) or None
    except OSError:
        return None


def _dns(p: Probe, s: socket.socket) -> tuple[str, str]:
    s.send(dns.message.make_query(p.qname or ".", "A").to_wire())
    data = s.recv(4096)
    try:
        reply = dns.message.from_wire(data)
    except dns.exception.DNSException as e:
        return "error:malformed answer", str(e)[:200]
    return f"answer:{dns.rcode.to_text(reply.rcode())}", ""


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # no CA store (loading it costs more than every probe together): any server that
    # completes a handshake is a failure, whoever signed its certificate
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _tls(p: Probe, s: socket.socket) -> tuple[str, str]:
    with _tls_context().wrap_socket(s, server_hostname=p.qname,
                                    do_handshake_on_connect=False) as t:
        t.do_handshake()
        return "handshake", f"a TLS server answered ({t.version()})"


def _http(p: Probe, s: socket.socket) -> tuple[str, str]:
    host = p.qname or f"{p.host}:{p.port}"
    s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while len(data) < 4096:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return http_verdict(data)


def _udp(p: Probe, s: socket.socket) -> tuple[str, str]:
    s.send(b"\xc0stockade-fence-probe")  # a QUIC long-header first byte
    # the reject's ICMP error is rate-limited per address (and slots reuse addresses): do
    # not wait for it. What proves the fence is the NFLOG reader's event; an answer that
    # comes later than this would come from a fence that logged nothing
    s.settimeout(min(UDP_WINDOW_S, s.gettimeout() or UDP_WINDOW_S))
    s.recv(2048)
    return "reply", "a UDP answer came back"


def _tcp6(p: Probe, s: socket.socket) -> tuple[str, str]:
    return "connected", "an IPv6 connection was accepted"


_RUN = {"dns": _dns, "tls": _tls, "http": _http, "udp": _udp, "tcp6": _tcp6}


def run_one(p: Probe, s: socket.socket, timeout: float) -> Observation:
    s.settimeout(timeout)
    port = None
    try:
        s.connect((p.host, p.port))  # a datagram socket: only fixes the peer and the port
        port = _port(s)  # before a TLS wrap takes the socket over
        outcome, detail = _RUN[p.kind](p, s)
    except OSError as e:
        outcome, detail = _os_outcome(e), str(e)[:200]
    finally:
        port = port or _port(s)
        s.close()
    return Observation(p.name, outcome, port, detail)


def run_probes(netns: str, probes: list[Probe], timeout: float) -> dict[str, Observation]:
    """Every probe at once from inside `netns`: name -> what it saw."""
    socks = sockets_in(netns, probes)
    with ThreadPoolExecutor(max_workers=len(probes) or 1,
                            thread_name_prefix="stockade-probe") as pool:
        done = list(pool.map(lambda ps: run_one(ps[0], ps[1], timeout),
                             zip(probes, socks, strict=True)))
    return {o.probe: o for o in done}
