"""NFLOG (nfnetlink_log) client: the kernel hands over packets that nft `log group N`
rules saw; the launcher turns them into `bypass_attempt` events.

Hand-written (struct-based) because the protocol is a few fixed TLVs and no maintained
Python library covers nfnetlink_log without C extensions. The parser is pure (bytes in,
records out) and unit-tested with captured bytes; `NflogSocket` only moves bytes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLMSG_ERROR = 2
NLMSG_DONE = 3

# packet attributes
NFULA_PACKET_HDR = 1
NFULA_IFINDEX_INDEV = 4
NFULA_HWADDR = 8
NFULA_PAYLOAD = 9
NFULA_PREFIX = 10
# config attributes
NFULA_CFG_CMD = 1
NFULA_CFG_MODE = 2
NFULA_CFG_TIMEOUT = 4
NFULA_CFG_QTHRESH = 5
NFULNL_CFG_CMD_BIND = 1
NFULNL_CFG_CMD_UNBIND = 2
NFULNL_COPY_PACKET = 2
NLA_TYPE_MASK = 0x3FFF  # strips NLA_F_NESTED / NLA_F_NET_BYTEORDER

_NLMSGHDR = struct.Struct("=IHHII")
_NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (big endian value)


@dataclass(frozen=True, slots=True)
class LogRecord:
    prefix: str
    ifindex: int | None
    family: str  # "ipv4" | "ipv6" | "other"
    src: str | None
    dst: str | None
    transport: str  # tcp | udp | icmp | ipv6-icmp | other
    sport: int | None
    dport: int | None
    hwaddr: str | None


def _align(n: int) -> int:
    return (n + 3) & ~3


def _attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    off = 0
    while off + 4 <= len(data):
        alen, atype = struct.unpack_from("=HH", data, off)
        if alen < 4 or off + alen > len(data):
            break
        out.setdefault(atype & NLA_TYPE_MASK, data[off + 4 : off + alen])
        off += _align(alen)
    return out


_PROTOS = {6: "tcp", 17: "udp", 1: "icmp", 58: "ipv6-icmp"}


def parse_l3(payload: bytes) -> tuple[str, str | None, str | None, str, int | None, int | None]:
    """(family, src, dst, transport, sport, dport) from an IP packet head; never raises."""
    if not payload:
        return "other", None, None, "other", None, None
    version = payload[0] >> 4
    if version == 4 and len(payload) >= 20:
        ihl = (payload[0] & 0x0F) * 4
        proto = payload[9]
        src = str(ipaddress.IPv4Address(payload[12:16]))
        dst = str(ipaddress.IPv4Address(payload[16:20]))
        l4 = payload[ihl:] if ihl >= 20 else b""
        fam = "ipv4"
    elif version == 6 and len(payload) >= 40:
        proto = payload[6]  # extension headers are not followed: reported as "other"
        src = str(ipaddress.IPv6Address(payload[8:24]))
        dst = str(ipaddress.IPv6Address(payload[24:40]))
        l4 = payload[40:]
        fam = "ipv6"
    else:
        return "other", None, None, "other", None, None
    transport = _PROTOS.get(proto, "other")
    sport = dport = None
    if transport in ("tcp", "udp") and len(l4) >= 4:
        sport, dport = struct.unpack_from("!HH", l4, 0)
    return fam, src, dst, transport, sport, dport


def parse_messages(buf: bytes) -> list[LogRecord]:
    """All NFULNL packet records in one recv() buffer; other messages are skipped."""
    out: list[LogRecord] = []
    off = 0
    while off + _NLMSGHDR.size <= len(buf):
        mlen, mtype, _flags, _seq, _pid = _NLMSGHDR.unpack_from(buf, off)
        if mlen < _NLMSGHDR.size or off + mlen > len(buf):
            break
        if mtype == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET:
            body = buf[off + _NLMSGHDR.size + _NFGENMSG.size : off + mlen]
            a = _attrs(body)
            prefix = a.get(NFULA_PREFIX, b"").split(b"\0", 1)[0].decode("ascii", "replace")
            ifindex = (struct.unpack("!I", a[NFULA_IFINDEX_INDEV][:4])[0]
                       if len(a.get(NFULA_IFINDEX_INDEV, b"")) >= 4 else None)
            hw = a.get(NFULA_HWADDR)
            hwaddr = None
            if hw is not None and len(hw) >= 4:
                hwlen = struct.unpack("!H", hw[:2])[0]
                raw = hw[4 : 4 + min(hwlen, 8)]
                hwaddr = ":".join(f"{x:02x}" for x in raw) if raw else None
            fam, src, dst, transport, sport, dport = parse_l3(a.get(NFULA_PAYLOAD, b""))
            out.append(LogRecord(prefix, ifindex, fam, src, dst, transport, sport, dport,
                                 hwaddr))
        off += _align(mlen)
    return out


def _nla(atype: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, atype) + payload + b"\0" * (_align(n) - n)


def config_message(group: int, attrs: bytes, seq: int = 1, family: int = 0) -> bytes:
    body = _NFGENMSG.pack(family, 0, socket.htons(group)) + attrs
    hdr = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG,
                         NLM_F_REQUEST | NLM_F_ACK, seq, 0)
    return hdr + body


def bind_messages(group: int, copy_range: int = 128) -> list[bytes]:
    """Bind the group, copy the first `copy_range` bytes, deliver each packet at once."""
    return [
        config_message(group, _nla(NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_BIND])), seq=1),
        config_message(group, _nla(NFULA_CFG_MODE,
                                   struct.pack("!IBB", copy_range, NFULNL_COPY_PACKET, 0)), seq=2),
        config_message(group, _nla(NFULA_CFG_QTHRESH, struct.pack("!I", 1)), seq=3),
        config_message(group, _nla(NFULA_CFG_TIMEOUT, struct.pack("!I", 1)), seq=4),
    ]


def parse_ack(buf: bytes) -> int | None:
    """errno of the first NLMSG_ERROR (0 = ack), None when there is none."""
    if len(buf) >= _NLMSGHDR.size + 4:
        _mlen, mtype, _f, _s, _p = _NLMSGHDR.unpack_from(buf, 0)
        if mtype == NLMSG_ERROR:
            return -struct.unpack_from("=i", buf, _NLMSGHDR.size)[0]
    return None


class NflogError(OSError):
    pass


class NflogSocket:
    """A bound NFLOG group. Only one socket per group on the host may bind (EBUSY else)."""

    def __init__(self, group: int) -> None:
        self.group = group
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            self.sock.bind((0, 0))
            self.sock.settimeout(2.0)
            for msg in bind_messages(group):
                self.sock.send(msg)
                err = parse_ack(self.sock.recv(65536))
                if err:
                    raise NflogError(err, f"NFLOG group {group}: {os.strerror(err)}")
        except BaseException:
            self.sock.close()
            raise

    def recv(self, timeout: float) -> list[LogRecord]:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 17)
        except (TimeoutError, BlockingIOError):
            return []
        except OSError as e:
            if e.errno == 105:  # ENOBUFS: the kernel dropped records; keep reading
                return []
            raise
        return parse_messages(data)

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv_ready(self) -> list[LogRecord]:
        """Every record already queued, without waiting."""
        out: list[LogRecord] = []
        self.sock.setblocking(False)  # a socket timeout would make recv wait for it first
        while True:
            try:
                data = self.sock.recv(1 << 17, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError, TimeoutError):
                return out
            except OSError as e:
                if e.errno == 105:  # ENOBUFS: the kernel dropped records; keep reading
                    continue
                raise
            out += parse_messages(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(config_message(self.group,
                                          _nla(NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_UNBIND]))))
        self.sock.close()
