"""The address a redirected connection was originally sent to (netfilter NAT lookup).

Used for the event log, the destination port and raw-TCP `cidr` rules only: the gateway
never dials this address for a named flow (the client chose it; the gateway resolves
the name itself).
"""

from __future__ import annotations

import socket
import struct

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
IP6T_SO_ORIGINAL_DST = 80  # linux/netfilter_ipv6/ip6_tables.h (on SOL_IPV6)


def original_destination(sock: socket.socket) -> tuple[str, int] | None:
    """(ip, port) before the nft redirect, or None when the connection was not redirected."""
    try:
        if sock.family == socket.AF_INET:
            raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
            port = struct.unpack_from("!H", raw, 2)[0]
            return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
        if sock.family == socket.AF_INET6:
            peer = sock.getpeername()[0]
            if peer.startswith("::ffff:") and "." in peer:
                # an IPv4 client on a dual-stack socket: conntrack holds an IPv4 entry
                raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
                port = struct.unpack_from("!H", raw, 2)[0]
                return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
            raw = sock.getsockopt(socket.IPPROTO_IPV6, IP6T_SO_ORIGINAL_DST, 28)
            port = struct.unpack_from("!H", raw, 2)[0]
            return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    except OSError:
        return None
    return None
