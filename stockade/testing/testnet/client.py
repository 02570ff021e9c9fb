"""`ClientNamespace`: a sandbox stand-in for gateway and DNS tests.

A namespace with a veth to the host (a /30 from 10.251.0.0/16), a default route via the
host side, and an nft table `stockade_t_<suffix>` (family inet) on the host that sends the
client's TCP to one host port, its port-53 traffic to another, and rejects the rest. The
launcher's production wiring is separate and richer; this is the minimum a gateway test
needs to see traffic arrive the way it will in production (redirected, original
destination recoverable with SO_ORIGINAL_DST).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

from stockade.lifecycle import StartStop
from stockade.testing._startup import stop_on_failure
from stockade.testing.testnet import host
from stockade.testing.testnet.layout import pick_client_block

_SUFFIX = re.compile(r"^[a-z0-9_]{1,24}\Z")


def nft_ruleset(
    table: str,
    iface: str,
    host_ip: str,
    redirect_tcp_port: int,
    redirect_dns_port: int,
    exempt_tcp_ports: Sequence[int] = (),
) -> str:
    """The host-side table for one client veth (pure, so it is unit-tested as text)."""
    exempt = ", ".join(str(p) for p in sorted(set(exempt_tcp_ports)))
    accept_tcp = ", ".join(
        str(p) for p in sorted({redirect_tcp_port, redirect_dns_port, *exempt_tcp_ports})
    )
    lines = [
        f"table inet {table} {{",
        "  chain prerouting {",
        "    type nat hook prerouting priority dstnat; policy accept;",
    ]
    if exempt:
        # exempt ports keep their destination (e.g. a broker on the host veth address)
        lines.append(f'    iifname "{iface}" ip daddr {host_ip} tcp dport {{ {exempt} }} return')
    lines += [
        f'    iifname "{iface}" meta l4proto {{ tcp, udp }} th dport 53 '
        f"redirect to :{redirect_dns_port}",
        f'    iifname "{iface}" meta l4proto tcp redirect to :{redirect_tcp_port}',
        "  }",
        "  chain input {",
        "    type filter hook input priority filter; policy accept;",
        f'    iifname != "{iface}" return',
        "    ct state established,related accept",
        f"    ip daddr {host_ip} tcp dport {{ {accept_tcp} }} accept",
        f"    ip daddr {host_ip} udp dport {redirect_dns_port} accept",
        "    meta l4proto tcp reject with tcp reset",
        "    reject with icmpx admin-prohibited",
        "  }",
        "  chain forward {",
        "    type filter hook forward priority filter; policy accept;",
        f'    iifname "{iface}" reject with icmpx admin-prohibited',
        f'    oifname "{iface}" reject with icmpx admin-prohibited',
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


class ClientNamespace(StartStop):
    """A client namespace whose traffic is redirected to host ports (see module doc).

    `address`: the client's IPv4 address, or None to take a free /30 from 10.251.0.0/16
    (the client gets the second host address, the host veth the first).
    """

    def __init__(
        self,
        name_suffix: str,
        address: str | None = None,
        redirect_tcp_port: int = 0,
        redirect_dns_port: int = 0,
        exempt_tcp_ports: Sequence[int] = (),
    ) -> None:
        if not _SUFFIX.match(name_suffix):
            raise ValueError("name_suffix: 1-24 characters of [a-z0-9_]")
        for p in (redirect_tcp_port, redirect_dns_port, *exempt_tcp_ports):
            if not 0 < p < 65536:
                raise ValueError(f"invalid port {p}")
        self.suffix = name_suffix
        self.requested_address = address
        self.redirect_tcp_port = redirect_tcp_port
        self.redirect_dns_port = redirect_dns_port
        self.exempt_tcp_ports = tuple(exempt_tcp_ports)
        self.namespace = f"skcl-{name_suffix}"
        self.host_if = f"skcl-{secrets.token_hex(3)}"  # <= 15 chars whatever the suffix
        self.ns_if = "eth0"
        self.nft_table = f"stockade_t_{name_suffix}"
        self.address = ""
        self.host_ip = ""
        self.network = ""
        self._started = False
        self._stopped = False
        self._lock = threading.RLock()  # reentrant: stop() may rerun from a signal handler

    def _addresses(self) -> tuple[str, str, int]:
        if self.requested_address is None:
            block = pick_client_block(host.used_networks())
            return str(block.network_address + 2), str(block.network_address + 1), 30
        ip = ipaddress.IPv4Address(self.requested_address)
        block = ipaddress.IPv4Network(f"{ip}/30", strict=False)
        hosts = list(block.hosts())
        if ip not in hosts:
            raise ValueError(f"{ip} is not a usable host address of {block}")
        peer = hosts[0] if ip == hosts[1] else hosts[1]
        return str(ip), str(peer), 30

    def start(self) -> ClientNamespace:
        if self._started:
            raise RuntimeError("ClientNamespace already started")
        reason = host.available()
        if reason:
            raise host.TestnetError(f"cannot build a client namespace: {reason}")
        if host.netns_exists(self.namespace) or host.nft_table_exists("inet", self.nft_table):
            raise host.TestnetError(f"{self.namespace} / {self.nft_table} already exist")
        self._started = True
        host.register_cleanup(self, self.stop)
        with stop_on_failure(self.stop):
            self._wire()
        return self

    def _wire(self) -> None:
        ns, hif = self.namespace, self.host_if
        with host.alloc_lock():
            self.address, self.host_ip, plen = self._addresses()
            self.network = str(ipaddress.IPv4Network(f"{self.address}/{plen}", strict=False))
            host.forget_flows(self.address)  # flows of an earlier client on this address
            host.write_owner(ns, ns, [hif], [self.nft_table])
            host.run(["ip", "netns", "add", ns])
            host.run(
                ["ip", "link", "add", hif, "type", "veth", "peer", "name", self.ns_if, "netns", ns]
            )
            host.run(["ip", "addr", "add", f"{self.host_ip}/{plen}", "dev", hif])
        # the table goes in before the link comes up: no packet ever passes unfiltered
        host.run(
            ["nft", "-f", "-"],
            input=nft_ruleset(
                self.nft_table,
                hif,
                self.host_ip,
                self.redirect_tcp_port,
                self.redirect_dns_port,
                self.exempt_tcp_ports,
            ),
        )
        host.run(["ip", "link", "set", hif, "up"])
        n = ["ip", "-n", ns]
        host.run([*n, "link", "set", "lo", "up"])
        host.run([*n, "addr", "add", f"{self.address}/{plen}", "dev", self.ns_if])
        host.run([*n, "link", "set", self.ns_if, "up"])
        host.run([*n, "route", "add", "default", "via", self.host_ip])
        # any port-53 destination is redirected anyway; this just gives getaddrinfo one
        host.write_resolv_conf(ns, self.host_ip)

    def stop(self) -> None:
        """Remove the nft table, namespace and veth. Idempotent."""
        with self._lock:
            if self._stopped or not self._started:
                return
            self._stopped = True
        try:
            host.remove_resources(self.namespace, [self.host_if], [self.nft_table])
            host.drop_owner(self.namespace)
        finally:
            host.unregister_cleanup(self)

    def _argv(self, argv: Sequence[str]) -> list[str]:
        if not self._started or self._stopped:
            raise RuntimeError("ClientNamespace not running")
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """`subprocess.run` inside the namespace (same keyword arguments)."""
        kw.setdefault("check", False)
        return subprocess.run(self._argv(argv), **kw)

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """`subprocess.Popen` inside the namespace."""
        return subprocess.Popen(self._argv(argv), **kw)
