"""Runs inside the sandbox: one early denial, then a TCP port scan, DNS queries and a UDP
flood; prints what it sent (JSON). Paced so that nothing is lost between the sandbox and
the host (the veth's backlog) where no counter could see it."""

import errno
import json
import os
import selectors
import socket
import struct
import sys
import time

target, first_port, last_port, n_dns, n_udp = (
    sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
gw = os.environ["STOCKADE_BROKER"].split("//")[1].split(":")[0]  # host side of the veth
out = {"early": "", "tcp_established": 0, "tcp_failed": 0, "dns_sent": 0, "udp_sent": 0}

# the early denial that the flood must not erase: a request for a name no rule allows
s = socket.create_connection((target, 80), timeout=10)
s.sendall(b"GET / HTTP/1.1\r\nHost: denied.test\r\nConnection: close\r\n\r\n")
out["early"] = s.recv(100).decode("latin1").split("\r\n")[0]
s.close()
out["tcp_established"] += 1

# the scan: non-blocking connects, IN_FLIGHT at a time
IN_FLIGHT = 200
sel = selectors.DefaultSelector()
ports = iter(range(first_port, last_port + 1))
pending = 0


def start_one() -> bool:
    global pending
    p = next(ports, None)
    if p is None:
        return False
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.setblocking(False)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    rc = c.connect_ex((target, p))
    if rc not in (0, errno.EINPROGRESS):
        out["tcp_failed"] += 1
        c.close()
        return True
    sel.register(c, selectors.EVENT_WRITE)
    pending += 1
    return True


while pending < IN_FLIGHT and start_one():
    pass
while pending:
    for key, _ in sel.select(timeout=30):
        c = key.fileobj
        sel.unregister(c)
        pending -= 1
        err = c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err == 0:
            out["tcp_established"] += 1
        else:
            out["tcp_failed"] += 1
        c.close()
        start_one()

# DNS: distinct names (a tunnel's shape), paced in bursts
d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
d.setblocking(False)
for i in range(n_dns):
    name = f"{i:08x}.exfil.test".encode()
    labels = b"".join(bytes([len(x)]) + x for x in name.split(b".")) + b"\0"
    q = struct.pack("!HHHHHH", i & 0xFFFF, 0x0100, 1, 0, 0, 0) + labels + b"\0\1\0\1"
    while True:
        try:
            d.sendto(q, (gw, 53))
            break
        except BlockingIOError:
            time.sleep(0.001)
    out["dns_sent"] += 1
    if i % 50 == 49:
        time.sleep(0.005)
        try:
            while d.recv(4096):
                pass
        except BlockingIOError:
            pass

# UDP flood to the target (blocked by the firewall, counted by nft)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(n_udp):
    try:
        u.sendto(b"x", (target, 9999))
        out["udp_sent"] += 1
    except OSError:
        pass
    if i % 50 == 49:
        time.sleep(0.002)
print(json.dumps(out))
