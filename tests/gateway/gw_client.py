"""Client behaviours run *inside* a client namespace (`python gw_client.py CMD ...`).

Each prints one JSON line with what it observed, so tests assert on facts, not timing.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import contextlib

from gw_tlsgen import long_alpn, refragment


def _ctx(cafile: str | None, alpn: list[str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cafile) if cafile else ssl.create_default_context()
    if not cafile:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def _recv_all(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    out = bytearray()
    while len(out) < limit:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _handshake_over(
    sock: socket.socket, obj: ssl.SSLObject, inc: ssl.MemoryBIO, out: ssl.MemoryBIO
) -> None:
    """Drive a memory-BIO TLS handshake over `sock` (the first flight is already sent)."""
    while True:
        try:
            obj.do_handshake()
            pending = out.read()
            if pending:
                sock.sendall(pending)
            return
        except ssl.SSLWantReadError:
            pending = out.read()
            if pending:
                sock.sendall(pending)
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed during handshake") from None
            inc.write(data)


def _tls_request(
    sock: socket.socket,
    sni: str,
    cafile: str | None,
    request: bytes,
    split_records: int = 0,
    seg: int = 0,
    ctx: ssl.SSLContext | None = None,
) -> dict[str, object]:
    alpn = [*long_alpn(1600), "http/1.1"] if split_records else None
    ctx = ctx or _ctx(cafile, alpn)
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    hello = out.read()
    info: dict[str, object] = {"hello_len": len(hello)}
    flight = refragment(hello, split_records) if split_records else hello
    if seg:
        for i in range(0, len(flight), seg):
            sock.sendall(flight[i : i + seg])
            time.sleep(0.002)  # separate TCP segments (TCP_NODELAY is set)
    else:
        sock.sendall(flight)
    try:
        _handshake_over(sock, obj, inc, out)
    except (ssl.SSLError, ConnectionError, OSError) as e:
        info["error"] = type(e).__name__ + ": " + str(e)[:200]
        return info
    obj.write(request)
    sock.sendall(out.read())
    body = bytearray()
    while True:
        try:
            chunk = obj.read(65536)
            if not chunk:
                break  # close_notify
            body += chunk
            continue
        except ssl.SSLWantReadError:
            pass
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            break
        data = sock.recv(65536)
        if not data:
            break
        inc.write(data)
    info["response"] = bytes(body).decode("latin-1")
    return info


def _hostile_payloads(seed: int, count: int) -> list[tuple[str, bytes]]:
    """Deterministic hostile first flights; none may ever be allowed (the only name any
    of them carries, forbidden.test, is not in the profile)."""
    import random

    from gw_tlsgen import real_client_hello

    rnd = random.Random(seed)
    hello = real_client_hello("forbidden.test")
    kinds = [
        ("random", lambda: rnd.randbytes(rnd.randint(1, 3000))),
        ("tls-header", lambda: b"\x16\x03\x01" + rnd.randbytes(rnd.randint(2, 2000))),
        ("tls-huge-length", lambda: b"\x16\x03\x01\xff\xff\x01\xff\xff\xff"),
        ("hello-truncated", lambda: hello[: rnd.randint(1, len(hello) - 1)]),
        ("hello-flipped", lambda: _flip(rnd, hello)),
        ("http-garbage", lambda: b"GET " + rnd.randbytes(rnd.randint(1, 500)) + b"\r\n\r\n"),
        ("http-nul", lambda: b"GET / HTTP/1.1\r\nHost: forbidden.test\0\r\n\r\n"),
        ("http-huge", lambda: b"GET / HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n"),
        ("connect-garbage", lambda: b"CONNECT " + rnd.randbytes(rnd.randint(1, 300)) + b"\r\n\r\n"),
    ]
    return [(k, make()) for k, make in (kinds[i % len(kinds)] for i in range(count))]


def _flip(rnd: object, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(1 + rnd.randint(0, 4)):  # type: ignore[attr-defined]
        out[rnd.randrange(len(out))] ^= 1 << rnd.randrange(8)  # type: ignore[attr-defined]
    return bytes(out)


def _fire(ip: str, port: int, payload: bytes) -> dict[str, object]:
    """Send one hostile first flight; report whether the gateway closed the connection
    (before this socket's own generous timeout) and how its answer starts."""
    sock = socket.create_connection((ip, port), timeout=10)
    local_port = sock.getsockname()[1]  # the source port the gateway's events name
    try:
        with contextlib.suppress(OSError):  # the gateway may close mid-send (over the cap)
            sock.sendall(payload)
        reply = bytearray()
        closed = False
        while len(reply) < 4096:
            try:
                chunk = sock.recv(4096)
            except ConnectionResetError:
                closed = True
                break
            except TimeoutError:
                break
            if not chunk:
                closed = True
                break
            reply += chunk
        return {"closed": closed, "reply": bytes(reply[:16]).hex(), "port": local_port}
    finally:
        sock.close()


# one context for a thousand handshakes: create_default_context loads the CA store each time
_NO_VERIFY = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
_NO_VERIFY.check_hostname = False
_NO_VERIFY.verify_mode = ssl.CERT_NONE


def _name_attempt(form: str, ip: str, port: int, name: str) -> str:
    """One connection naming `name` (as SNI, Host or CONNECT authority): the gateway's
    X-Stockade-Deny reason, "tls_alert" for a refused handshake, "closed" when the gateway
    closed without an answer, "status ..." for an answer that is neither, or "through":
    the site itself answered. A CONNECT's 200 alone is not "through": the gateway dials
    (and so resolves) the authority only for the bytes the tunnel carries, so a TLS request
    for `name` goes through it."""
    sock = socket.create_connection((ip, port), timeout=10)
    try:
        if form == "sni":
            return _through_tls(sock, name)
        if form == "host":
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
        else:
            sock.sendall(f"CONNECT {name}:443 HTTP/1.1\r\nHost: {name}:443\r\n\r\n".encode())
        head = read_head(sock)
        lines = head.split(b"\r\n")
        for line in lines:
            if line.lower().startswith(b"x-stockade-deny:"):
                return line.split(b":", 1)[1].strip().decode()
        if not head:
            return "closed"
        status = lines[0].split(b" ", 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1."):
            return "status " + lines[0][:40].decode("latin-1")
        if form == "connect":
            if status[1] != b"200":
                return "status " + status[1].decode("latin-1")
            return _through_tls(sock, name)
        return "through"
    except OSError as e:
        return type(e).__name__
    finally:
        sock.close()


def read_head(sock: socket.socket) -> bytes:
    """An HTTP response head (or what came before the peer closed: b"" for nothing)."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    return head


def _through_tls(sock: socket.socket, name: str) -> str:
    req = f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode()
    got = _tls_request(sock, name, None, req, ctx=_NO_VERIFY)
    return "through" if "response" in got else "tls_alert"


def main(argv: list[str]) -> dict[str, object]:
    cmd = argv[0]
    if cmd == "names":  # names sni|host|connect IP PORT FILE -> one connection per name
        form, ip, port, path = argv[1], argv[2], int(argv[3]), argv[4]
        with open(path) as f:
            names = f.read().split()
        got = [_name_attempt(form, ip, port, n) for n in names]
        return {"outcomes": {k: got.count(k) for k in set(got)}}
    if cmd == "hostile":  # hostile IP PORT SEED COUNT
        ip, port, seed, count = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        return {"results": [
            {"kind": kind, **_fire(ip, port, payload)}
            for kind, payload in _hostile_payloads(seed, count)
        ]}
    if cmd == "tls":  # tls IP PORT SNI CAFILE|- [split_records] [segment]
        ip, port, sni, ca = argv[1], int(argv[2]), argv[3], argv[4]
        split = int(argv[5]) if len(argv) > 5 else 0
        seg = int(argv[6]) if len(argv) > 6 else 0
        sock = socket.create_connection((ip, port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        host = sni.rstrip(".")
        req = f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        return _tls_request(sock, sni, None if ca == "-" else ca, req, split, seg)
    if cmd == "connect-tls":  # connect-tls PROXY_IP PROXY_PORT AUTHORITY SNI
        ip, port, authority, sni = argv[1], int(argv[2]), argv[3], argv[4]
        sock = socket.create_connection((ip, port), timeout=10)
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = read_head(sock)
        status = head.split(b"\r\n", 1)[0].decode("latin-1")
        if " 200 " not in status + " ":
            return {"connect": status, "body": head.decode("latin-1")}
        req = f"GET / HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n".encode()
        info = _tls_request(sock, sni, None, req)
        info["connect"] = status
        return info
    if cmd == "raw":  # raw IP PORT PAYLOAD -> send, half-close, read to EOF
        ip, port, payload = argv[1], int(argv[2]), argv[3].encode()
        sock = socket.create_connection((ip, port), timeout=10)
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        return {"received": _recv_all(sock).decode("latin-1")}
    if cmd == "send-read":  # send-read IP PORT PAYLOAD -> send, read to EOF (no half-close)
        ip, port, payload = argv[1], int(argv[2]), argv[3].encode()
        sock = socket.create_connection((ip, port), timeout=10)
        sock.sendall(payload)
        return {"received": _recv_all(sock).decode("latin-1")}
    if cmd == "two-requests":  # two-requests IP PORT HOST1 HOST2, on one connection
        ip, port, host1, host2 = argv[1], int(argv[2]), argv[3], argv[4]
        sock = socket.create_connection((ip, port), timeout=10)
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {host1}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            body += sock.recv(65536)
        try:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {host2}\r\n\r\n".encode())
            second = _recv_all(sock)
        except OSError as e:
            second = type(e).__name__.encode()
        return {
            "first": head.split(b"\r\n")[0].decode(),
            "first_head": head.decode(),
            "second": second.decode("latin-1"),
        }
    if cmd == "slow":  # slow IP PORT HEX -> send a prefix, then wait for the gateway
        ip, port, prefix = argv[1], int(argv[2]), bytes.fromhex(argv[3])
        sock = socket.create_connection((ip, port), timeout=20)
        sock.sendall(prefix)
        return {"received": _recv_all(sock).hex(), "closed": True}
    if cmd == "mute":  # mute IP PORT -> connect, report, send nothing, wait for close
        sock = socket.create_connection((argv[1], int(argv[2])), timeout=30)
        print(json.dumps({"ready": True}), flush=True)
        return {"closed": sock.recv(1) == b""}
    if cmd == "hold":  # hold IP PORT SNI -> open a TLS tunnel, report, wait for close
        ip, port, sni = argv[1], int(argv[2]), argv[3]
        sock = socket.create_connection((ip, port), timeout=10)
        tls = _ctx(None).wrap_socket(sock, server_hostname=sni)
        print(json.dumps({"ready": True}), flush=True)
        tls.settimeout(30)
        try:
            data = tls.recv(1)
        except (ssl.SSLError, OSError) as e:
            return {"closed": True, "how": type(e).__name__}
        return {"closed": data == b"", "how": "eof"}
    if cmd == "upload":  # upload IP PORT SNI NBYTES
        ip, port, sni, n = argv[1], int(argv[2]), argv[3], int(argv[4])
        sock = socket.create_connection((ip, port), timeout=10)
        tls = _ctx(None).wrap_socket(sock, server_hostname=sni)
        head = (
            f"POST /upload HTTP/1.1\r\nHost: {sni}\r\nContent-Length: {n}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        sent = 0
        try:
            tls.sendall(head)
            block = b"u" * 16384
            while sent < n:
                sent += tls.send(block[: n - sent])
            resp = _recv_all(tls)
        except (ssl.SSLError, OSError) as e:
            return {"sent": sent, "error": type(e).__name__}
        return {"sent": sent, "response": resp.decode("latin-1")}
    raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
