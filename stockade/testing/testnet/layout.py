"""Address plan of the fake internet: which name lives at which address.

Pure functions, so the plan (and the choice of a free subnet on a shared machine) is
unit-tested without touching the network. Offsets are fixed inside the subnet, so a test
that knows `allowed.test` is `.10` keeps working when a busy machine pushes us to another
/24; callers should still read addresses from `FakeInternet.addresses`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

DEFAULT_SUBNET = "10.250.0.0/24"
# where free /24s are searched for when the requested subnet is taken
SEARCH_SPACE = "10.250.0.0/16"
# client namespaces carve /30s from here (see client.py)
CLIENT_SPACE = "10.251.0.0/16"

# host offsets inside the subnet; kept in one table so docs and code agree
WEB_HOSTS: dict[str, int] = {
    "allowed.test": 10,
    "denied.test": 11,
    "echo.test": 12,
    "pypi.test": 13,
    "api.test": 14,
    "other.test": 15,
    "git.test": 16,
}
# sites that also answer for every name under them (DNS and certificate): an index and a
# git server under wildcard allow entries, as files.pythonhosted.org or *.github.com are
WILDCARD_SITES = ("pypi.test", "git.test")
HOST_OFFSET = 1
NS_OFFSET = 2
RAW_ECHO_OFFSET = 20
DNS_OFFSET = 53
TCP_ECHO_PORT = 7000
UDP_ECHO_PORT = 7001
IPV6_NAME = "ipv6.test"


@dataclass(frozen=True)
class Layout:
    """Every address of one fake internet, derived from its IPv4 subnet."""

    subnet: str
    host_ip: str
    ns_ip: str
    addresses: dict[str, str]
    raw_echo_ip: str
    dns_server: str
    prefixlen: int
    ipv6_prefix: str
    host_ip6: str
    ns_ip6: str
    ipv6_address: str
    extra_ips: tuple[str, ...] = field(default=())

    @property
    def ns_ips(self) -> list[str]:
        """IPv4 addresses configured on the namespace side (servers bind to these)."""
        ips = [self.ns_ip, *self.addresses.values(), self.raw_echo_ip, self.dns_server]
        return list(dict.fromkeys(ips))


def _ula_for(net: ipaddress.IPv4Network) -> ipaddress.IPv6Network:
    # One ULA /64 per IPv4 /24 (third octet in the subnet id), so two fake internets
    # never share an IPv6 prefix either. fd5c:ade::/48 is arbitrary but not fd00::/64,
    # which some CI hosts use on their uplink.
    third = int(net.network_address) >> 8 & 0xFF
    return ipaddress.IPv6Network(f"fd5c:ade:0:{third:x}::/64")


def plan(subnet: str = DEFAULT_SUBNET) -> Layout:
    """The address plan for `subnet` (an IPv4 network of at least /26)."""
    net = ipaddress.IPv4Network(subnet, strict=True)
    if net.prefixlen > 26:
        raise ValueError(f"subnet {subnet} too small: need at least a /26 (offsets up to .53)")
    base = net.network_address

    def at(offset: int) -> str:
        return str(base + offset)

    v6 = _ula_for(net)
    v6base = v6.network_address
    return Layout(
        subnet=str(net),
        host_ip=at(HOST_OFFSET),
        ns_ip=at(NS_OFFSET),
        addresses={name: at(off) for name, off in WEB_HOSTS.items()},
        raw_echo_ip=at(RAW_ECHO_OFFSET),
        dns_server=at(DNS_OFFSET),
        prefixlen=net.prefixlen,
        ipv6_prefix=str(v6),
        host_ip6=str(v6base + 1),
        ns_ip6=str(v6base + 2),
        ipv6_address=str(v6base + 0x10),
    )


def overlaps_any(
    net: ipaddress.IPv4Network | ipaddress.IPv6Network,
    used: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network],
) -> bool:
    return any(net.version == u.version and net.overlaps(u) for u in used)


def candidate_subnets(requested: str, space: str = SEARCH_SPACE) -> Iterator[str]:
    """The requested subnet first, then every /24 of the search space in order."""
    yield str(ipaddress.IPv4Network(requested, strict=True))
    for sub in ipaddress.IPv4Network(space).subnets(new_prefix=24):
        if str(sub) != requested:
            yield str(sub)


def pick_subnet(
    requested: str,
    used: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network],
    space: str = SEARCH_SPACE,
) -> str:
    """First candidate overlapping none of `used` (host routes and addresses)."""
    used = [u for u in used if u.prefixlen > 0]  # a default route overlaps everything
    for cand in candidate_subnets(requested, space):
        layout = plan(cand)
        nets = [ipaddress.ip_network(cand), ipaddress.ip_network(layout.ipv6_prefix)]
        if not any(overlaps_any(n, used) for n in nets):
            return cand
    raise RuntimeError(f"no free /24 for the fake internet in {space}")


def pick_client_block(
    used: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network],
    space: str = CLIENT_SPACE,
) -> ipaddress.IPv4Network:
    """First /30 of the client space overlapping none of `used`."""
    used = [u for u in used if u.prefixlen > 0]
    for block in ipaddress.IPv4Network(space).subnets(new_prefix=30):
        if not overlaps_any(block, used):
            return block
    raise RuntimeError(f"no free /30 for a client namespace in {space}")
