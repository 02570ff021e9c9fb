"""Shares of a connection cap (pure): a global limit plus a limit per source.

The DNS firewall's TCP listener takes one share per connection: with only the global cap,
one sandbox holding `max_tcp_connections` idle connections starved every other sandbox's
DNS-over-TCP; with a per-source cap as well, it can hold at most its own share.
"""

from __future__ import annotations


class Shares:
    def __init__(self, total: int, per_key: int) -> None:
        if total < 1 or per_key < 1:
            raise ValueError("caps must be at least 1")
        self.total = total
        self.per_key = per_key
        self.held: dict[str, int] = {}  # key -> shares held (only keys holding any)
        self.count = 0

    def acquire(self, key: str) -> str | None:
        """Take one share for `key`; None when granted, else which cap refused it
        (`"global"` or `"per_source"`)."""
        if self.count >= self.total:
            return "global"
        mine = self.held.get(key, 0)
        if mine >= self.per_key:
            return "per_source"
        self.held[key] = mine + 1
        self.count += 1
        return None

    def release(self, key: str) -> None:
        mine = self.held.get(key, 0)
        if mine <= 0:
            raise ValueError(f"release of {key!r} without a share")
        if mine == 1:
            del self.held[key]
        else:
            self.held[key] = mine - 1
        self.count -= 1
