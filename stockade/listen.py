"""Listen addresses (`host:port`, `[v6]:port`): one pure parser for loading and binding.

The settings models validate every listen address with `parse_listen` when stockade.yaml
is loaded, and the servers bind with what the same function returns, so an address that
loads is one a server can parse (a bad one is a config error, not a start-up traceback).
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import AfterValidator

from stockade.net.addresses import is_ip_literal


def parse_listen(addr: str, default_port: int | None = None) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), the host without brackets.

    With `default_port`, a bare host (or a bare IPv6 literal) takes that port. Raises
    ValueError saying what is wrong."""
    if not isinstance(addr, str) or not addr or addr != addr.strip():
        raise ValueError(f"{addr!r} is not an address (want host:port)")
    if addr.startswith("["):
        host, port = _split_bracketed(addr, default_port)
        if isinstance(port, int):
            return host, port  # a bare [v6] with the default port
    else:
        host, port = _split_plain(addr, default_port)
    return host, _port(addr, port)


def _split_bracketed(addr: str, default_port: int | None) -> tuple[str, str | int]:
    """'[v6]:port' -> (v6, port text); a bare '[v6]' -> (v6, `default_port`) when given."""
    host, closed, rest = addr[1:].partition("]")
    if not closed:
        raise ValueError(f"{addr!r}: missing ']' (want [v6]:port)")
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ValueError(f"{addr!r}: {host!r} is not an IPv6 address") from None
    if not rest and default_port is not None:
        return host, default_port
    if not rest.startswith(":"):
        raise ValueError(f"{addr!r}: no port (want [v6]:port)")
    return host, rest[1:]


def _split_plain(addr: str, default_port: int | None) -> tuple[str, str]:
    """'host:port' -> (host, port text); a bare host (or IPv6 literal) takes `default_port`."""
    if default_port is not None and (":" not in addr or is_ip_literal(addr, 6)):
        host, port_text = addr, str(default_port)
    else:
        host, colon, port_text = addr.rpartition(":")
        if not colon:
            raise ValueError(f"{addr!r}: no port (want host:port)")
        if ":" in host:
            # "::1:80" is ambiguous (port 80, or the address ::1:80?)
            raise ValueError(f"{addr!r}: an IPv6 address needs brackets: [v6]:port")
    if not host:
        raise ValueError(f"{addr!r}: no host (want host:port, e.g. 0.0.0.0{addr})")
    if any(c.isspace() or not c.isprintable() for c in host):
        raise ValueError(f"{addr!r}: invalid character in host")
    return host, port_text


def _port(addr: str, port_text: str) -> int:
    # isascii: str.isdigit() is also true for digits int() refuses ('²')
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"{addr!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{addr!r}: port {port} is out of range (0-65535)")
    return port


def _check_listen(addr: str) -> str:
    parse_listen(addr)
    return addr  # kept as written: the server parses it again when it binds


def _check_listen_or_empty(addr: str) -> str:
    return addr if addr == "" else _check_listen(addr)


def _check_dns_server(addr: str) -> str:
    host, _ = parse_listen(addr, default_port=53)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{addr!r}: {host!r} is not an IP address (want ip or ip:port)") from None
    return addr


# for settings fields: a str that must parse as a listen address
ListenAddress = Annotated[str, AfterValidator(_check_listen)]
# the same, or "" where an empty address turns that listener off
OptionalListenAddress = Annotated[str, AfterValidator(_check_listen_or_empty)]
# an upstream DNS server: "ip", "ip:port" or "[v6]:port" (port 53 when not given)
DnsServerAddress = Annotated[str, AfterValidator(_check_dns_server)]
