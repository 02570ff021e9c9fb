"""The gateway's one resolver, shared by the TCP path and the DNS firewall.

dnspython's async resolver does the wire work (UDP with TCP fallback, CNAME chaining);
what is hand-written here is the part no library gives us: a cache keyed by name whose
TTL is clamped to [ttl_min, ttl_max] (so a TTL-0 rebinding name keeps one checked answer
for ttl_min on both paths), single-flight (concurrent lookups of a name share one upstream
query), negative caching, and the special-purpose check of every returned address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from .addresses import AddressPolicy


@dataclass(frozen=True, slots=True)
class Resolution:
    name: str  # normalised: lower case, no trailing dot
    cnames: tuple[str, ...]  # CNAME targets in chain order (name -> cnames[0] -> ...)
    addresses: tuple[str, ...]  # only checked, dialable addresses (canonical text)
    forbidden: tuple[tuple[str, str], ...]  # (address, category) removed by the check
    ttl: int  # clamped TTL this entry is cached for
    error: str | None  # None, "nxdomain", "servfail", "timeout", "invalid_name"
    expires_at: float = 0.0  # monotonic time at which the cached entry lapses

    def remaining_ttl(self, now: float | None = None) -> int:
        """Seconds left in the cache (what a DNS answer may promise a client)."""
        t = time.monotonic() if now is None else now
        return max(0, min(self.ttl, int(self.expires_at - t + 0.999)))


def parse_server(server: str) -> tuple[str, int]:
    """'ip' or 'ip:port' or '[v6]:port' to (ip, port)."""
    if server.startswith("["):
        host, _, rest = server[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else 53
    if server.count(":") == 1:
        host, port = server.split(":")
        return host, int(port)
    return server, 53


def normalize_name(name: str) -> str:
    return name.strip().rstrip(".").lower()


@dataclass(frozen=True, slots=True)
class _Partial:
    cnames: tuple[str, ...]
    addresses: tuple[str, ...]
    ttl: int | None
    error: str | None


class Resolver:
    def __init__(
        self,
        servers: Sequence[str],
        address_policy: AddressPolicy,
        ttl_min: int = 5,
        ttl_max: int = 300,
        timeout: float = 2.0,
        max_entries: int = 10000,
    ) -> None:
        if not servers:
            raise ValueError("at least one upstream DNS server is required")
        if ttl_min > ttl_max:
            raise ValueError("ttl_min must not exceed ttl_max")
        self.servers = tuple(parse_server(s) for s in servers)
        self.address_policy = address_policy
        self.ttl_min = ttl_min
        self.ttl_max = ttl_max
        self.timeout = timeout
        self.max_entries = max_entries
        self._cache: OrderedDict[str, Resolution] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[Resolution]] = {}
        self._dns = dns.asyncresolver.Resolver(configure=False)
        self._dns.nameservers = [dns.nameserver.Do53Nameserver(h, p) for h, p in self.servers]
        self._dns.timeout = timeout
        self._dns.lifetime = timeout
        self._dns.cache = None  # our cache is the only one: one answer for both paths
        # counters for metrics (read by the DNS firewall and the gateway)
        self.hits = 0
        self.misses = 0
        self.upstream_queries = 0

    def clamp(self, ttl: int) -> int:
        return max(self.ttl_min, min(self.ttl_max, ttl))

    def cached(self, name: str, now: float | None = None) -> Resolution | None:
        """The live cache entry for `name`, without querying upstream."""
        key = normalize_name(name)
        res = self._cache.get(key)
        if res is None:
            return None
        if res.expires_at <= (time.monotonic() if now is None else now):
            del self._cache[key]
            return None
        return res

    async def resolve(self, name: str) -> Resolution:
        key = normalize_name(name)
        res = self.cached(key)
        if res is not None:
            self.hits += 1
            return res
        fut = self._inflight.get(key)
        if fut is not None:
            self.hits += 1  # answered by the query already in flight
            return await asyncio.shield(fut)
        self.misses += 1
        # the lookup runs as its own task: a cancelled caller must not fail the others
        task = asyncio.ensure_future(self._lookup_and_store(key))
        self._inflight[key] = task
        return await asyncio.shield(task)

    async def _lookup_and_store(self, key: str) -> Resolution:
        try:
            res = await self._lookup(key)
            self._store(key, res)
            return res
        finally:
            self._inflight.pop(key, None)

    def invalidate(self, name: str | None = None) -> None:
        if name is None:
            self._cache.clear()
        else:
            self._cache.pop(normalize_name(name), None)

    def _store(self, key: str, res: Resolution) -> None:
        self._cache[key] = res
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)

    async def _lookup(self, key: str) -> Resolution:
        try:
            qname = dns.name.from_text(key)
        except (dns.exception.DNSException, ValueError, UnicodeError):
            return self._finish(key, _Partial((), (), None, "invalid_name"))
        self.upstream_queries += 2
        a, aaaa = await asyncio.gather(
            self._query(qname, dns.rdatatype.A), self._query(qname, dns.rdatatype.AAAA)
        )
        if "nxdomain" in (a.error, aaaa.error):
            return self._finish(key, _Partial(a.cnames or aaaa.cnames, (), None, "nxdomain"))
        addresses = a.addresses + aaaa.addresses
        cnames = a.cnames if len(a.cnames) >= len(aaaa.cnames) else aaaa.cnames
        ttls = [t for t in (a.ttl, aaaa.ttl) if t is not None]
        error = None
        if not addresses:
            # one family failing while the other answered nothing is still a failure
            error = a.error or aaaa.error
        return self._finish(key, _Partial(cnames, addresses, min(ttls) if ttls else None, error))

    def _finish(self, key: str, p: _Partial) -> Resolution:
        ok: list[str] = []
        forbidden: list[tuple[str, str]] = []
        for raw in dict.fromkeys(p.addresses):
            addr = str(ipaddress.ip_address(raw))
            cat = self.address_policy.check(addr)
            if cat is None:
                ok.append(addr)
            else:
                forbidden.append((addr, cat))
        # negative answers and failures are cached for ttl_min
        ttl = self.clamp(p.ttl) if p.ttl is not None and p.error is None else self.ttl_min
        return Resolution(
            name=key,
            cnames=p.cnames,
            addresses=tuple(ok),
            forbidden=tuple(forbidden),
            ttl=ttl,
            error=p.error,
            expires_at=time.monotonic() + ttl,
        )

    async def _query(self, qname: dns.name.Name, rdtype: dns.rdatatype.RdataType) -> _Partial:
        try:
            answer = await self._dns.resolve(qname, rdtype, search=False, raise_on_no_answer=False)
        except dns.resolver.NXDOMAIN:
            return _Partial((), (), None, "nxdomain")
        except dns.resolver.LifetimeTimeout:
            return _Partial((), (), None, "timeout")
        except (dns.resolver.NoNameservers, dns.resolver.YXDOMAIN):
            return _Partial((), (), None, "servfail")
        except dns.exception.Timeout:
            return _Partial((), (), None, "timeout")
        except (dns.exception.DNSException, OSError, ValueError):
            # malformed upstream reply, CNAME loop, unreachable socket: fail closed
            return _Partial((), (), None, "servfail")
        chain = answer.chaining_result
        cnames = tuple(
            normalize_name(rrset[0].target.to_text()) for rrset in chain.cnames if len(rrset)
        )
        addresses: tuple[str, ...] = ()
        if answer.rrset is not None:
            addresses = tuple(str(rd.address) for rd in answer.rrset if rd.rdtype == rdtype)
        ttl = chain.minimum_ttl if (addresses or cnames) else None
        return _Partial(cnames, addresses, ttl, None)
