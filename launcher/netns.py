"""Network namespace + veth for one sandbox, through `ip -batch` (one process per side).

The sandbox side is created directly inside the namespace (`peer ... netns`), so no
host-visible temporary interface exists; IPv6 link-local generation is off on both ends.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
from pathlib import Path

from . import nssysctl
from .addresses import SlotAddresses

NETNS_DIR = "/run/netns"
GUEST_IF = "eth0"


class NetnsError(RuntimeError):
    pass


def _batch(lines: list[str], netns: str | None = None, force: bool = False) -> None:
    argv = ["ip"]
    if force:
        argv.append("-force")
    if netns is not None:
        argv += ["-n", netns]
    argv += ["-batch", "-"]
    proc = subprocess.run(argv, input="\n".join(lines).encode() + b"\n", capture_output=True,
                          check=False)
    if proc.returncode != 0 and not force:
        raise NetnsError(proc.stderr.decode("utf-8", "replace").strip()[:1000])


def host_commands(netns: str, ifname: str, a: SlotAddresses) -> list[str]:
    return [
        f"netns add {netns}",
        f"link add {ifname} address {a.host_mac} type veth peer name {GUEST_IF} "
        f"address {a.guest_mac} netns {netns}",
        f"link set {ifname} addrgenmode none",
        f"addr add {a.host_ip}/{a.prefixlen} dev {ifname}",
        f"link set {ifname} up",
    ]


def guest_commands(a: SlotAddresses) -> list[str]:
    return [
        "link set lo up",
        f"link set {GUEST_IF} addrgenmode none",
        f"addr add {a.guest_ip}/{a.prefixlen} dev {GUEST_IF}",
        f"link set {GUEST_IF} up",
        f"route add default via {a.host_ip} dev {GUEST_IF}",
    ]


def tap_commands(tap: str) -> list[str]:
    """The microVM backend's netns: no address at all (nothing in it talks), a tap for QEMU."""
    return [
        "link set lo up",
        f"link set {GUEST_IF} addrgenmode none",
        f"link set {GUEST_IF} up",
        f"tuntap add dev {tap} mode tap",
        f"link set {tap} addrgenmode none",
        f"link set {tap} up",
    ]


def mirred_commands(tap: str, a: SlotAddresses) -> list[str]:
    """`tc -batch`: frames pass unchanged between eth0 and the tap (u32 + mirred, both widely
    built in), so the guest's frames reach the host-side veth with the guest's own address
    and MAC, and nft judges them as it judges a netns sandbox's. Towards the host only what
    the guest may send passes: IPv4 from its MAC, and ARP from its MAC and address asking
    for the host side's; anything else (another MAC, IPv6, other ethertypes, ARP for other
    addresses) matches no filter and ends in this netns, which has no address to answer
    and forwards nothing."""
    mac = a.guest_mac
    spa = ipaddress.IPv4Address(a.guest_ip).packed
    tpa = int(ipaddress.IPv4Address(a.host_ip))
    redirect = f"action mirred egress redirect dev {GUEST_IF}"
    return [
        f"qdisc add dev {GUEST_IF} ingress",
        f"filter add dev {GUEST_IF} parent ffff: protocol all u32 match u32 0 0 "
        f"action mirred egress redirect dev {tap}",
        f"qdisc add dev {tap} ingress",
        f"filter add dev {tap} parent ffff: protocol ip prio 1 u32 match ether src {mac} "
        f"{redirect}",
        # ARP (offsets from the ARP header): sender address at 14 (2-byte aligned: two
        # u16), target address at 24
        f"filter add dev {tap} parent ffff: protocol arp prio 2 u32 match ether src {mac} "
        f"match u16 0x{spa[:2].hex()} 0xffff at 14 match u16 0x{spa[2:].hex()} 0xffff at 16 "
        f"match u32 0x{tpa:08x} 0xffffffff at 24 {redirect}",
    ]


def harden_host_side(ifname: str) -> None:
    """The host-side veth answers ARP only for its own address on it (arp_ignore=2: the
    target address must be on this interface and in the sender's subnet) and announces
    only that one (arp_announce=2): a sandbox cannot map the host's other addresses.
    (Through `nssysctl`: in a container /proc/sys is read-only.)"""
    nssysctl.write(None, [(f"net.ipv4.conf.{ifname}.{name}", "2")
                          for name in ("arp_ignore", "arp_announce")])


def _tc_batch(lines: list[str], netns: str) -> None:
    proc = subprocess.run(["tc", "-n", netns, "-batch", "-"],
                          input="\n".join(lines).encode() + b"\n", capture_output=True,
                          check=False)
    if proc.returncode != 0:
        raise NetnsError(proc.stderr.decode("utf-8", "replace").strip()[:1000])


def create(netns: str, ifname: str, a: SlotAddresses, tap: str | None = None) -> int:
    """Create both ends; returns the host-side ifindex (NFLOG records carry it). With `tap`
    (the microVM backend) the netns gets that tap joined to its veth end instead of the
    sandbox's address."""
    # IPv6 stays enabled (without any address) on the host side on purpose: with it
    # disabled the kernel drops IPv6 before netfilter and the attempt would go unreported
    _batch(host_commands(netns, ifname, a))
    try:
        harden_host_side(ifname)
    except OSError as e:
        raise NetnsError(f"cannot set the ARP sysctls of {ifname}: {e}") from None
    if tap is None:
        _batch(guest_commands(a), netns=netns)
    else:
        _batch(tap_commands(tap), netns=netns)
        _tc_batch(mirred_commands(tap, a), netns)
    return int(Path(f"/sys/class/net/{ifname}/ifindex").read_text())


def destroy(netns: str, ifname: str) -> None:
    """Idempotent: missing pieces are fine."""
    _batch([f"link del {ifname}", f"netns del {netns}"], force=True)
    # `netns del` fails silently if the bind mount is busy; remove the file when possible
    p = os.path.join(NETNS_DIR, netns)
    if os.path.exists(p):
        subprocess.run(["umount", "-l", p], capture_output=True, check=False)
        with contextlib.suppress(OSError):
            os.unlink(p)


def exists(netns: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, netns))


def list_netns(prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(NETNS_DIR) if n.startswith(prefix + "-")]
    except FileNotFoundError:
        return []


def list_links(prefix: str) -> list[str]:
    try:
        names = os.listdir("/sys/class/net")
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith(prefix) and len(n) > len(prefix)]
