"""The special-purpose address registry: which resolved addresses the gateway may dial.

Hand-written rather than `ipaddress.is_global` because the stdlib's flags differ between
Python versions (3.11 calls multicast and CGNAT-adjacent blocks "global"), know nothing of
cloud metadata endpoints, and do not look inside IPv4-embedding IPv6 prefixes. The table
below is data (IANA IPv4/IPv6 special-purpose registries plus metadata endpoints); the
lookup is a most-specific-first scan over integer (value, mask) pairs, so it is cheap and
never raises.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Cloud metadata endpoints: never dialled unless an `allow` entry names exactly this address.
METADATA_ADDRESSES: tuple[str, ...] = (
    "169.254.169.254",  # AWS, GCP, Azure IMDS, OpenStack, ...
    "169.254.170.2",  # AWS ECS task metadata
    "169.254.169.253",  # AWS DNS (VPC)
    "fd00:ec2::254",  # AWS IMDS over IPv6
    "fd00:ec2::253",  # AWS DNS over IPv6
    "168.63.129.16",  # Azure wireserver
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",  # Oracle Cloud (OCI) metadata
)

# (block, category). Sources: IANA "IPv4/IPv6 Special-Purpose Address Registry",
# RFC 1918, RFC 6598, RFC 5737/3849/9637 (documentation), RFC 2544 (benchmarking).
# Globally reachable special-purpose blocks (AS112, AMT) are forbidden too: an agent has
# no business dialling them and failing closed costs nothing.
SPECIAL_PURPOSE: tuple[tuple[str, str], ...] = (
    # --- IPv4 ---
    ("0.0.0.0/8", "unspecified"),  # "this network"
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "cgnat"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link_local"),
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "reserved"),  # IETF protocol assignments (DS-Lite, NAT64 discovery, ...)
    ("192.0.2.0/24", "documentation"),  # TEST-NET-1
    ("192.31.196.0/24", "reserved"),  # AS112-v4
    ("192.52.193.0/24", "reserved"),  # AMT
    ("192.88.99.0/24", "reserved"),  # deprecated 6to4 relay anycast
    ("192.168.0.0/16", "private"),
    ("192.175.48.0/24", "reserved"),  # AS112 direct delegation
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),  # TEST-NET-2
    ("203.0.113.0/24", "documentation"),  # TEST-NET-3
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),
    ("255.255.255.255/32", "broadcast"),
    # --- IPv6 ---
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "ipv4_embedded"),  # IPv4-compatible (deprecated)
    ("::ffff:0:0/96", "ipv4_embedded"),  # IPv4-mapped
    ("::ffff:0:0:0/96", "ipv4_embedded"),  # IPv4-translated (SIIT)
    ("64:ff9b::/96", "ipv4_embedded"),  # NAT64 well-known prefix
    ("64:ff9b:1::/48", "ipv4_embedded"),  # NAT64 local-use
    ("100::/64", "discard"),  # discard-only
    ("100:0:0:1::/64", "reserved"),  # dummy prefix (RFC 9780)
    ("2001::/23", "reserved"),  # IETF protocol assignments (ORCHID, AMT, AS112, ...)
    ("2001::/32", "ipv4_embedded"),  # Teredo
    ("2001:2::/48", "benchmarking"),
    ("2001:db8::/32", "documentation"),
    ("2002::/16", "ipv4_embedded"),  # 6to4
    ("2620:4f:8000::/48", "reserved"),  # AS112 direct delegation
    ("3fff::/20", "documentation"),
    ("5f00::/16", "reserved"),  # SRv6 SIDs
    ("fc00::/7", "unique_local"),
    ("fe80::/10", "link_local"),
    ("fec0::/10", "site_local"),  # deprecated site-local
    ("ff00::/8", "multicast"),
)

# IPv6 outside 2000::/3 is not allocated for global unicast at all.
_GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")

_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")
_COMPAT = ipaddress.IPv6Network("::/96")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
_SIXTOFOUR = ipaddress.IPv6Network("2002::/16")
_TEREDO = ipaddress.IPv6Network("2001::/32")


@dataclass(frozen=True, slots=True)
class _Block:
    value: int
    mask: int
    prefixlen: int
    category: str


def _compile(
    entries: Iterable[tuple[IPNetwork, str]],
) -> tuple[tuple[_Block, ...], tuple[_Block, ...]]:
    """Split by family and order most-specific first, so the first hit is the best match."""
    v4: list[_Block] = []
    v6: list[_Block] = []
    for net, cat in entries:
        blk = _Block(int(net.network_address), int(net.netmask), net.prefixlen, cat)
        (v4 if net.version == 4 else v6).append(blk)
    v4.sort(key=lambda b: -b.prefixlen)
    v6.sort(key=lambda b: -b.prefixlen)
    return tuple(v4), tuple(v6)


def _lookup(blocks: tuple[_Block, ...], value: int) -> str | None:
    for b in blocks:
        if value & b.mask == b.value:
            return b.category
    return None


_TABLE_V4, _TABLE_V6 = _compile((ipaddress.ip_network(n), c) for n, c in SPECIAL_PURPOSE)


def _special_category(addr: IPAddress, v4: bool, value: int) -> str | None:
    """The registry's category for `addr`; IPv6 outside global unicast is "reserved"."""
    category = _lookup(_TABLE_V4 if v4 else _TABLE_V6, value)
    if category is None and not v4 and addr not in _GLOBAL_UNICAST_V6:
        return "reserved"
    return category


def parse_address(ip: object) -> IPAddress | None:
    """Any str / bytes / int / ipaddress value to an address, or None when it is not one."""
    try:
        if isinstance(ip, ipaddress.IPv4Address | ipaddress.IPv6Address):
            return ip
        if isinstance(ip, bool):
            return None
        if isinstance(ip, int):
            return ipaddress.ip_address(ip)
        if isinstance(ip, bytes | bytearray | memoryview):
            raw = bytes(ip)
            if len(raw) in (4, 16):
                return ipaddress.ip_address(raw)
            ip = raw.decode("ascii")
        if isinstance(ip, str):
            addr = ipaddress.ip_address(ip.strip("[]"))
            if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id:
                # the zone does not change where the address points; drop it for lookups
                addr = ipaddress.IPv6Address(int(addr))
            return addr
    except (ValueError, UnicodeDecodeError, TypeError):
        return None
    return None


def is_ip_literal(text: str, version: int | None = None) -> bool:
    """Is `text` an IP address as written (of `version` when given)? Unlike
    `parse_address`, nothing is taken off first: brackets make it not one."""
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return False
    return version is None or addr.version == version


def embedded_ipv4(addr: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (mapped, compat, NAT64, 6to4, Teredo)."""
    v = int(addr)
    out: list[ipaddress.IPv4Address] = []
    low32 = ipaddress.IPv4Address(v & 0xFFFFFFFF)
    if any(addr in n for n in (_MAPPED, _TRANSLATED, _COMPAT, _NAT64, _NAT64_LOCAL)):
        out.append(low32)
    elif addr in _SIXTOFOUR:
        out.append(ipaddress.IPv4Address((v >> 80) & 0xFFFFFFFF))
    elif addr in _TEREDO:
        out.append(ipaddress.IPv4Address((v >> 64) & 0xFFFFFFFF))  # Teredo server
        out.append(ipaddress.IPv4Address(~v & 0xFFFFFFFF))  # obfuscated client address
    return out


class AddressPolicy:
    """Decides whether a resolved address may be dialled.

    `allow`: CIDRs (or bare addresses) exempt from the special-purpose check, for test
    networks and internal mirrors. A metadata address is exempt only when listed exactly
    (as itself or a /32, /128). `own`: the gateway's own addresses, always forbidden (a
    connection to ourselves would reach the control API / metrics or loop).
    """

    def __init__(self, allow: Sequence[str] = (), own: Sequence[str] = ()) -> None:
        self.allow: tuple[IPNetwork, ...] = tuple(
            ipaddress.ip_network(a, strict=False) for a in allow
        )
        self.own: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(a, strict=False) for a in own)
        self._metadata = frozenset(ipaddress.ip_address(a) for a in METADATA_ADDRESSES)
        # exact single-address allow entries, the only way to exempt a metadata address
        self._exact_allow = frozenset(n.network_address for n in self.allow if n.num_addresses == 1)
        self._allow_v4, self._allow_v6 = _compile((n, "allow") for n in self.allow)
        self._own_v4, self._own_v6 = _compile((n, "own_address") for n in self.own)

    def check(self, ip: object) -> str | None:
        """None when `ip` may be dialled, else the category that forbids it."""
        addr = parse_address(ip)
        if addr is None:
            return "invalid"
        return self._check(addr, depth=0)

    def _check(self, addr: IPAddress, depth: int) -> str | None:
        v4 = addr.version == 4
        if self._is_own(addr, v4):
            return "own_address"
        if addr in self._metadata and addr not in self._exact_allow:
            return "metadata"
        value = int(addr)
        allowed = _lookup(self._allow_v4 if v4 else self._allow_v6, value) is not None
        category = _special_category(addr, v4, value)
        if isinstance(addr, ipaddress.IPv6Address) and depth == 0:
            inner_cat = self._embedded_category(addr)
            if inner_cat is not None:
                # an exempted translation prefix still may not reach a forbidden IPv4
                return category if category is not None and not allowed else inner_cat
        return None if allowed else category

    def _is_own(self, addr: IPAddress, v4: bool) -> bool:
        if _lookup(self._own_v4 if v4 else self._own_v6, int(addr)) is not None:
            return True
        # a dual-stack socket dials the mapped IPv4 address: the gateway's own
        # addresses must stay forbidden in that spelling too
        mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
        return mapped is not None and _lookup(self._own_v4, int(mapped)) is not None

    def _embedded_category(self, addr: ipaddress.IPv6Address) -> str | None:
        """The first forbidding category among the IPv4 addresses `addr` carries."""
        for inner in embedded_ipv4(addr):
            inner_cat = self._check(inner, depth=1)
            if inner_cat is not None:
                return inner_cat
        return None

    def dialable(self, ip: object) -> bool:
        return self.check(ip) is None
