"""The fence self-test's probes from inside a microVM guest: run by the guest's Python
(`-I -S`) as one exec of the guest agent, as the sandbox user under its seccomp filter,
before the task's command starts. launcher/vmprobes.py sends it and reads its report.

Arguments: the per-probe timeout (seconds), then one `name|kind|host|port|qname` per probe
(launcher/selftest.py `Probe`). Output: one `name<TAB>outcome<TAB>source port<TAB>detail`
line per probe, with the outcomes of launcher/probes.py (the host-side runner of the
other tiers), so the same verdict (selftest.judge) applies.

Only builtin modules (`_socket`, `errno`, `os`, `sys`): every import is read over 9p and
run under emulation when the host has no KVM, where `socket` (enum, selectors) or `ssl`
cost a second. So the TLS probes send a ClientHello built here: the fence must refuse it
before any server could answer, and a handshake record coming back is the failure.
"""

import _socket
import errno
import os
import sys

UDP_WINDOW_S = 0.01  # as launcher/probes.py: the NFLOG reader's event is the evidence
RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}
# EAFNOSUPPORT: the guest kernel has no IPv6 at all, so nothing of it can leave
UNREACHABLE = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
REFUSED = (errno.ECONNREFUSED, errno.EACCES, errno.EPERM)


def dns_query(name):
    labels = b"".join(bytes([len(x)]) + x for x in name.rstrip(".").encode().split(b".") if x)
    return os.urandom(2) + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + labels + \
        b"\x00\x00\x01\x00\x01"  # QTYPE A, QCLASS IN


def _vec(n, data):
    return len(data).to_bytes(n, "big") + data


def client_hello(name):
    """A TLS 1.2/1.3 ClientHello, with `name` as SNI when given."""
    ext = b""
    if name:
        host = name.encode()
        ext += b"\x00\x00" + _vec(2, _vec(2, b"\x00" + _vec(2, host)))
    ext += b"\x00\x0a" + _vec(2, _vec(2, b"\x00\x1d\x00\x17"))  # groups: x25519, P-256
    ext += b"\x00\x0d" + _vec(2, _vec(2, b"\x04\x03\x08\x04"))  # signature algorithms
    ext += b"\x00\x2b" + _vec(2, _vec(1, b"\x03\x04\x03\x03"))  # versions 1.3, 1.2
    body = b"\x03\x03" + os.urandom(32) + b"\x00" + _vec(2, b"\x13\x01\xc0\x2f\x00\x2f") + \
        b"\x01\x00" + _vec(2, ext)
    hs = b"\x01" + _vec(3, body)
    return b"\x16\x03\x01" + _vec(2, hs)


def recv_some(s, limit=4096):
    data = b""
    while len(data) < limit:
        chunk = s.recv(limit)
        if not chunk:
            break
        data += chunk
    return data


def run_dns(p, s):
    s.send(dns_query(p["qname"] or "."))
    data = s.recv(4096)
    if len(data) < 12:
        return "error:malformed answer", f"{len(data)} bytes"
    return "answer:" + RCODES.get(data[3] & 0x0F, str(data[3] & 0x0F)), ""


def run_tls(p, s):
    s.sendall(client_hello(p["qname"]))
    data = s.recv(4096)
    if data[:1] == b"\x16":
        return "handshake", "a TLS server answered with a handshake record"
    return "closed", ""  # an alert or the end of the stream: the handshake was refused


def run_http(p, s):
    host = p["qname"] or f"{p['host']}:{p['port']}"
    s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    return http_verdict(recv_some(s))


def http_verdict(data):
    """An HTTP probe's outcome from what came back (launcher/probes.py's too)."""
    if not data:
        return "closed", ""
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    if head[0].split(" ")[1:2] == ["403"]:
        for line in head[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "x-stockade-deny":
                return "denied:" + v.strip(), ""
    return "connected", f"answered {head[0][:80]!r}"


def run_udp(p, s):
    s.send(b"\xc0stockade-fence-probe")  # a QUIC long-header first byte
    s.settimeout(UDP_WINDOW_S)
    s.recv(2048)
    return "reply", "a UDP answer came back"


def run_tcp6(p, s):
    return "connected", "an IPv6 connection was accepted"


RUN = {"dns": run_dns, "tls": run_tls, "http": run_http, "udp": run_udp, "tcp6": run_tcp6}


def os_outcome(e):
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, ConnectionResetError):
        return "reset"
    if e.errno in UNREACHABLE:
        return "unreachable"
    if e.errno in REFUSED:
        return "refused"
    return "error:" + errno.errorcode.get(e.errno or 0, type(e).__name__)


def probe(p, timeout):
    family = _socket.AF_INET6 if p["kind"] == "tcp6" else _socket.AF_INET
    kind = _socket.SOCK_DGRAM if p["kind"] in ("dns", "udp") else _socket.SOCK_STREAM
    port = 0
    try:
        s = _socket.socket(family, kind)
    except OSError as e:
        return os_outcome(e), 0, str(e)[:200]
    try:
        s.settimeout(timeout)
        s.connect((p["host"], p["port"]))
        port = s.getsockname()[1]
        outcome, detail = RUN[p["kind"]](p, s)
    except OSError as e:
        outcome, detail = os_outcome(e), str(e)[:200]
    finally:
        s.close()
    return outcome, port, detail


def parse(arg):
    name, kind, host, port, qname = arg.split("|")
    return {"name": name, "kind": kind, "host": host, "port": int(port), "qname": qname or None}


def main(argv):
    timeout = float(argv[0])
    for p in [parse(a) for a in argv[1:]]:
        outcome, port, detail = probe(p, timeout)
        clean = detail.replace("\t", " ").replace("\n", " ")
        sys.stdout.write(f"{p['name']}\t{outcome}\t{port}\t{clean}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
