"""Where the broker dials: the same checked resolution the gateway uses.

API definitions are trusted config, but a definition's host can still resolve to a
metadata or private address (a hijacked record, a typo): the broker resolves through
Stockade's resolver (configured servers, clamped cache) and dials only addresses that
pass the special-purpose check, exactly like the gateway (ARCHITECTURE principle 3).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult

from stockade.net.addresses import AddressPolicy
from stockade.net.resolver import Resolver


class UpstreamResolveError(OSError):
    """No dialable address for an upstream host (its text never reaches a caller)."""


class CheckedResolver(AbstractResolver):
    """aiohttp resolver backed by `stockade.net.resolver.Resolver`."""

    def __init__(self, resolver: Resolver, policy: AddressPolicy) -> None:
        self.resolver = resolver
        self.policy = policy

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_UNSPEC
    ) -> list[ResolveResult]:
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            if self.policy.check(literal) is not None:
                raise UpstreamResolveError(f"upstream address {host} is forbidden")
            addrs: tuple[str, ...] = (str(literal),)
        else:
            res = await self.resolver.resolve(host)
            if not res.addresses:
                why = res.error or ("forbidden address" if res.forbidden else "no address")
                raise UpstreamResolveError(f"cannot resolve upstream {host}: {why}")
            addrs = res.addresses
        out: list[ResolveResult] = []
        for a in addrs:
            fam = socket.AF_INET6 if ":" in a else socket.AF_INET
            if family in (socket.AF_INET, socket.AF_INET6) and family != fam:
                continue
            out.append(
                {
                    "hostname": host,
                    "host": a,
                    "port": port,
                    "family": fam,
                    "proto": 0,
                    "flags": socket.AI_NUMERICHOST,
                }
            )
        if not out:
            raise UpstreamResolveError(f"no usable address for upstream {host}")
        return out

    async def close(self) -> None:
        return None


def checked_resolver(config: Any) -> CheckedResolver:
    """Build from a `stockade.config.Config` (gateway resolvers and allow_addresses)."""
    gw = config.gateway
    policy = AddressPolicy(allow=gw.allow_addresses)
    return CheckedResolver(
        Resolver(gw.resolvers, policy, ttl_min=config.dns.ttl_min_s, ttl_max=config.dns.ttl_max_s),
        policy,
    )
