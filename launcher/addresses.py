"""Sandbox address plan: the pool is cut into /30 blocks, one per sandbox (pure).

Slot i owns block i: .1 is the host side of the veth, .2 the sandbox. The MAC of the
sandbox side is derived from its address (locally administered, 02:...), so the
anti-spoofing set can pin (interface, IPv4, MAC) without any extra bookkeeping.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotAddresses:
    slot: int
    host_ip: str
    guest_ip: str
    prefixlen: int
    host_mac: str
    guest_mac: str


def pool_size(pool: str) -> int:
    net = ipaddress.IPv4Network(pool, strict=True)
    if net.prefixlen > 30:
        raise ValueError(f"address pool {pool} is smaller than one /30")
    return net.num_addresses // 4


def _mac(kind: int, ip: ipaddress.IPv4Address) -> str:
    b = bytes([0x02, kind]) + ip.packed
    return ":".join(f"{x:02x}" for x in b)


def slot_addresses(pool: str, slot: int) -> SlotAddresses:
    net = ipaddress.IPv4Network(pool, strict=True)
    if not 0 <= slot < pool_size(pool):
        raise ValueError(f"slot {slot} outside pool {pool}")
    base = int(net.network_address) + 4 * slot
    host = ipaddress.IPv4Address(base + 1)
    guest = ipaddress.IPv4Address(base + 2)
    return SlotAddresses(slot, str(host), str(guest), 30, _mac(0x01, host), _mac(0x00, guest))


def free_slot(pool: str, used: Iterable[int]) -> int:
    """Lowest slot not in `used`; raises when the pool is exhausted (fail closed)."""
    taken = set(used)
    for i in range(pool_size(pool)):
        if i not in taken:
            return i
    raise RuntimeError(f"address pool {pool} exhausted ({len(taken)} sandboxes)")
