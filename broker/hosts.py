"""Pinned upstream addresses (`broker.hosts`), like curl's --resolve.

For private deployments and tests whose API names no resolver knows. Pinned names are
trusted configuration and are not address-checked; names not listed go to the
`fallback` resolver (the service passes the checked resolver of `upstream_dns.py`).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from typing import Any

from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver


class PinnedResolver(AbstractResolver):
    def __init__(self, pinned: Mapping[str, str], fallback: AbstractResolver | None = None) -> None:
        self.pinned = {k.lower().rstrip("."): str(ipaddress.ip_address(v))
                       for k, v in pinned.items()}
        self._default = fallback or DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[Any]:
        ip = self.pinned.get(host.lower().rstrip("."))
        if ip is None:
            return await self._default.resolve(host, port, family)
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        return [{"hostname": host, "host": ip, "port": port, "family": fam,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}]

    async def close(self) -> None:
        await self._default.close()
