"""What the server process inside the fake internet's namespace must start.

The parent (`FakeInternet`) writes this as JSON; `stockade.testing.testnet.serve` reads it. A
plain file rather than argv because it carries a zone and many listeners.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stockade.testing.testnet.zone import ZoneSpec


@dataclass
class Site:
    name: str  # host name the site serves (also its certificate's name)
    address: str
    cert_pem: str  # path: certificate chain
    key_pem: str  # path: private key
    http_port: int = 80
    https_port: int = 443


@dataclass
class ServeSpec:
    sites: list[Site]
    dns_address: str
    zone: ZoneSpec
    api_key: str
    tcp_echo: tuple[str, int]
    udp_echo: tuple[str, int]
    dns_port: int = 53
    query_log: str | None = None  # path: the DNS server appends "QTYPE name" per query
    git_root: str | None = None  # path: bare repositories git.test serves
    projects: int = 1  # demo projects pypi.test serves (benches: many small packages)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "sites": [vars(s) for s in self.sites],
            "dns_address": self.dns_address,
            "dns_port": self.dns_port,
            "zone": self.zone.to_json(),
            "api_key": self.api_key,
            "tcp_echo": list(self.tcp_echo),
            "udp_echo": list(self.udp_echo),
            "query_log": self.query_log,
            "git_root": self.git_root,
            "projects": self.projects,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServeSpec:
        return cls(
            sites=[Site(**s) for s in data["sites"]],
            dns_address=data["dns_address"],
            dns_port=int(data.get("dns_port", 53)),
            zone=ZoneSpec.from_json(data["zone"]),
            api_key=data["api_key"],
            tcp_echo=(data["tcp_echo"][0], int(data["tcp_echo"][1])),
            udp_echo=(data["udp_echo"][0], int(data["udp_echo"][1])),
            query_log=data.get("query_log"),
            git_root=data.get("git_root"),
            projects=int(data.get("projects", 1)),
            extra=dict(data.get("extra", {})),
        )

    def write(self, path: Path) -> None:
        # the spec carries the demo API key: owner-only, like every secret file
        path.touch(mode=0o600)
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def read(cls, path: Path) -> ServeSpec:
        return cls.from_json(json.loads(path.read_text()))
