"""The fake internet seen from the host: DNS, HTTPS, pip, echo, IPv6 (real namespace)."""

from __future__ import annotations

import itertools
import json
import secrets
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.resolver
import pytest

from stockade.testing.testnet import FakeInternet
from stockade.testing.testnet.gitrepo import DEMO_BRANCH, DEMO_COMMITS, DEMO_REPO, git_env
from stockade.testing.testnet.layout import WEB_HOSTS

pytestmark = pytest.mark.netns


def resolver(fi: FakeInternet, timeout: float = 3.0) -> dns.resolver.Resolver:
    r = dns.resolver.Resolver(configure=False)
    r.nameservers = [fi.dns_server]
    r.lifetime = timeout
    r.cache = None
    return r


def a_records(fi: FakeInternet, name: str, qtype: str = "A") -> list[str]:
    return sorted(rd.to_text() for rd in resolver(fi).resolve(name, qtype))


def https_get(fi: FakeInternet, name: str, path: str, headers: str = "") -> tuple[int, bytes]:
    """One HTTP/1.1 request over TLS, dialled to the fake address, verified with the CA."""
    ctx = ssl.create_default_context(cafile=fi.ca_pem)
    with (
        socket.create_connection((fi.addresses[name], 443), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=name) as tls,
    ):
        tls.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {name}\r\n{headers}Connection: close\r\n\r\n"
            .encode()
        )
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_attributes(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    assert fi.namespace.startswith("skinet-")
    assert set(WEB_HOSTS) <= set(fi.addresses)
    assert fi.dns_server.endswith(".53")
    assert fi.host_ip.endswith(".1")
    assert Path(fi.ca_pem).read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert fi.api_key


@pytest.mark.parametrize("name", sorted(WEB_HOSTS))
def test_site_names_resolve_over_udp_and_tcp(fake_internet: FakeInternet, name: str) -> None:
    fi = fake_internet
    q = dns.message.make_query(name, "A")
    for send in (dns.query.udp, dns.query.tcp):
        reply = send(q, fi.dns_server, timeout=5)
        assert [rd.to_text() for rrset in reply.answer for rd in rrset] == [fi.addresses[name]]


def test_trap_names_over_the_wire(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    assert a_records(fi, "private.test") == ["10.0.0.5"]
    assert a_records(fi, "metadata.test") == ["169.254.169.254"]
    assert a_records(fi, "loopback.test") == ["127.0.0.1"]
    assert a_records(fi, "cgnat.test") == ["100.64.0.7"]
    assert a_records(fi, "mixed.test") == sorted([fi.addresses["allowed.test"], "10.0.0.5"])
    assert a_records(fi, "mapped.test", "AAAA") == [f"::ffff:{fi.addresses['allowed.test']}"]
    assert a_records(fi, "ipv6.test", "AAAA") == [fi.ipv6_address]
    assert a_records(fi, "cname.test") == [fi.addresses["allowed.test"]]
    assert a_records(fi, "txt.test", "TXT") == ['"stockade fake internet txt record"']
    for name in ("nothing.test", "x1.tunnel.test"):
        with pytest.raises(dns.resolver.NXDOMAIN):
            resolver(fi).resolve(name, "A")
    # a zone that answers every name, and the server's log of what it was asked
    tag = secrets.token_hex(4)
    assert a_records(fi, f"{tag}.wild.test") == [fi.addresses["allowed.test"]]
    assert (f"{tag}.wild.test", "A") in fi.dns_queries()


def test_rebinding_alternates(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    q = dns.message.make_query("rebind.test", "A")
    seen = []
    for _ in range(4):
        reply = dns.query.udp(q, fi.dns_server, timeout=5)
        assert reply.answer[0].ttl == 0
        seen.append(reply.answer[0][0].to_text())
    assert set(seen) == {fi.addresses["allowed.test"], "127.0.0.1"}
    assert all(a != b for a, b in itertools.pairwise(seen))


@pytest.mark.slow
def test_slow_name_outlasts_a_short_timeout(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    q = dns.message.make_query("slow.test", "A")
    with pytest.raises(dns.exception.Timeout):
        dns.query.udp(q, fi.dns_server, timeout=1)
    # the server keeps answering other names while slow.test waits
    assert a_records(fi, "allowed.test") == [fi.addresses["allowed.test"]]
    late = dns.query.udp(q, fi.dns_server, timeout=30)
    assert late.answer[0][0].to_text() == fi.addresses["allowed.test"]


@pytest.mark.parametrize("name", sorted(WEB_HOSTS))
def test_https_index_with_the_ca(fake_internet: FakeInternet, name: str) -> None:
    status, body = https_get(fake_internet, name, "/")
    assert status == 200
    assert name.encode() in body


def test_each_name_has_its_own_certificate(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    ctx = ssl.create_default_context(cafile=fi.ca_pem)
    addr = fi.addresses["denied.test"]
    with (
        socket.create_connection((addr, 443), timeout=10) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        ctx.wrap_socket(raw, server_hostname="allowed.test")


def test_untrusted_without_the_ca(fake_internet: FakeInternet) -> None:
    ctx = ssl.create_default_context()
    addr = fake_internet.addresses["allowed.test"]
    with (
        socket.create_connection((addr, 443), timeout=10) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        ctx.wrap_socket(raw, server_hostname="allowed.test")


def test_curl_resolve_https_and_http(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    out = subprocess.run(
        ["curl", "-sS", "--cacert", fi.ca_pem, *fi.resolve_args("echo.test"),
         "-H", "X-Probe: 1", "-d", "hello", "https://echo.test/some/path?x=y"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["method"] == "POST"
    assert (doc["path"], doc["query"], doc["body"]) == ("/some/path", "x=y", "hello")
    assert doc["headers"]["X-Probe"] == "1"
    plain = subprocess.run(
        ["curl", "-sS", *fi.resolve_args("other.test", 80), "http://other.test/"],
        capture_output=True, text=True, timeout=30,
    )
    assert "other.test" in plain.stdout


def test_bytes_and_upload(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    out = subprocess.run(
        ["curl", "-sS", "--cacert", fi.ca_pem, *fi.resolve_args("allowed.test"),
         "-o", "/dev/null", "-w", "%{size_download}", "https://allowed.test/bytes/5000000"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.stdout == "5000000"
    up = subprocess.run(
        ["curl", "-sS", "--cacert", fi.ca_pem, *fi.resolve_args("allowed.test"),
         "--data-binary", "@-", "https://allowed.test/upload"],
        input=b"z" * 1_000_000, capture_output=True, timeout=60,
    )
    assert json.loads(up.stdout) == {"received": 1_000_000}


def test_api_whoami_over_tls(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    ok, body = https_get(fi, "api.test", "/v1/whoami", f"Authorization: Bearer {fi.api_key}\r\n")
    assert (ok, json.loads(body)) == (200, {"user": "demo"})
    denied, body = https_get(fi, "api.test", "/v1/whoami")
    assert denied == 401
    assert fi.api_key.encode() not in body
    ok_q, _ = https_get(fi, "api.test", f"/v1/whoami-query?key={fi.api_key}")
    assert ok_q == 200


def test_urllib_inside_the_namespace_uses_fake_dns(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    code = (
        "import ssl, sys, urllib.request\n"
        "ctx = ssl.create_default_context(cafile=sys.argv[1])\n"
        "url = 'https://allowed.test/'\n"
        "print(urllib.request.urlopen(url, context=ctx, timeout=10).read().decode())\n"
    )
    out = fi.run([sys.executable, "-c", code, fi.ca_pem], capture_output=True, text=True,
                 timeout=60)
    assert out.returncode == 0, out.stderr
    assert "allowed.test" in out.stdout


@pytest.mark.slow
def test_pip_download_from_pypi_test(fake_internet: FakeInternet, tmp_path: Path) -> None:
    fi = fake_internet
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null"}
    out = fi.run(
        [sys.executable, "-m", "pip", "download", "--no-cache-dir",
         "--disable-pip-version-check", "--no-deps", "--index-url", "https://pypi.test/simple",
         "--cert", fi.ca_pem, "-d", str(tmp_path / "dl"), "stockade-demo-pkg"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert [p.name for p in (tmp_path / "dl").iterdir()] == [
        "stockade_demo_pkg-1.0-py3-none-any.whl"
    ]


def test_git_clone_from_git_test_and_names_under_it(
    fake_internet: FakeInternet, tmp_path: Path
) -> None:
    """git's smart HTTP over TLS, from the direct vantage point: git.test and any name
    under it (one address, a certificate covering *.git.test) serve the demo repository."""
    fi = fake_internet
    served = subprocess.run(
        ["git", "--git-dir", str(fi.git_root / DEMO_REPO), "rev-parse", DEMO_BRANCH],
        capture_output=True, text=True, check=True, env=git_env(tmp_path),
    ).stdout.strip()  # fmt: skip
    for i, name in enumerate(["git.test", f"m{secrets.token_hex(3)}.git.test"]):
        gitc = ["git", "-c", f"http.sslCAInfo={fi.ca_pem}"]
        url = f"https://{name}/{DEMO_REPO}"
        out = fi.run([*gitc, "clone", "-q", url, str(tmp_path / f"w{i}")],
                     capture_output=True, text=True, timeout=120, env=git_env(tmp_path))
        assert out.returncode == 0, out.stderr
        head = fi.run(["git", "-C", str(tmp_path / f"w{i}"), "rev-parse", "HEAD"],
                      capture_output=True, text=True, env=git_env(tmp_path))
        assert head.stdout.strip() == served
        assert (tmp_path / f"w{i}" / "hello.py").read_text() == DEMO_COMMITS[-1].files["hello.py"]
    # without the CA, git refuses the certificate
    out = fi.run(["git", "ls-remote", f"https://git.test/{DEMO_REPO}"],
                 capture_output=True, text=True, timeout=60, env=git_env(tmp_path))
    assert out.returncode != 0 and "certificate" in out.stderr.lower()


def test_tcp_and_udp_echo(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    with socket.create_connection(fi.tcp_echo, timeout=10) as s:
        s.sendall(b"ping over tcp")
        assert s.recv(100) == b"ping over tcp"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.settimeout(10)
        u.sendto(b"ping over udp", fi.udp_echo)
        data, peer = u.recvfrom(100)
    assert (data, peer) == (b"ping over udp", fi.udp_echo)


def test_ipv6_site(fake_internet: FakeInternet) -> None:
    fi = fake_internet
    out = subprocess.run(
        ["curl", "-sS", "-6", "--cacert", fi.ca_pem,
         "--resolve", f"ipv6.test:443:[{fi.ipv6_address}]", "https://ipv6.test/"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "ipv6.test" in out.stdout


def test_namespace_has_no_route_out(fake_internet: FakeInternet) -> None:
    routes = subprocess.run(
        ["ip", "-n", fake_internet.namespace, "-j", "route", "show", "table", "all"],
        capture_output=True, text=True, check=True,
    )
    assert not [r for r in json.loads(routes.stdout) if r.get("dst") == "default"]
