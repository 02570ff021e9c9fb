"""Squid with ssl-bump (intercepting TLS) for inspector_bench's peer row.

Debian's Squid is built with GnuTLS and cannot bump; `squid-openssl` is the same Squid
built with OpenSSL, but it `Conflicts: squid` (installing it would replace the
CONNECT-allowlist Squid that gateway_bench and other users of the host run). So the
bench fetches the package with `apt-get download` (the ordinary client of the host's
package archive) and unpacks it with `dpkg -x` into a cache directory of its own: the
binary and its certificate helper run from there, beside the installed Squid, with the
data files (`/usr/share/squid`) of the installed `squid-common`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

PACKAGE = "squid-openssl"


def cache_dir() -> Path:
    """Not under root's home (0700): Squid's certificate helper runs as `proxy` and must
    be able to execute it. STOCKADE_BENCH_CACHE overrides."""
    base = os.environ.get("STOCKADE_BENCH_CACHE") or "/var/cache/stockade-bench"
    return Path(base) / PACKAGE


def unpacked(cache: Path | None = None) -> Path:
    """The root `squid-openssl` is unpacked into (fetched on first use); RuntimeError
    with the reason when it cannot be had."""
    root = (cache or cache_dir()) / "root"
    if (root / "usr" / "sbin" / "squid").exists():
        return root
    for tool in ("apt-get", "dpkg"):
        if not shutil.which(tool):
            raise RuntimeError(f"{tool} not found: {PACKAGE} needs a Debian host")
    dl = root.parent / "deb"
    dl.mkdir(parents=True, exist_ok=True)
    for p in (dl.parent.parent, dl.parent, dl):
        p.chmod(0o755)
    got = subprocess.run(
        ["apt-get", "download", PACKAGE], cwd=dl, capture_output=True, text=True, timeout=300
    )
    debs = sorted(dl.glob(f"{PACKAGE}_*.deb"))
    if got.returncode != 0 or not debs:
        raise RuntimeError(f"apt-get download {PACKAGE} failed: {got.stderr.strip()[-300:]}")
    subprocess.run(["dpkg", "-x", str(debs[-1]), str(root)], check=True, timeout=120)
    return root


def config(d: Path, listen: str, root: Path, upstream_ca: str, host: str) -> str:
    """squid.conf: bump every CONNECT to `host` (resolved from d/hosts), nothing else."""
    return textwrap.dedent(
        f"""\
        http_port {listen} ssl-bump generate-host-certificates=on \\
            dynamic_cert_mem_cache_size=4MB tls-cert={d}/ca.pem tls-key={d}/ca.key
        sslcrtd_program {root}/usr/lib/squid/security_file_certgen -s {d}/ssl_db -M 4MB
        sslcrtd_children 2 startup=1 idle=1
        acl step1 at_step SslBump1
        ssl_bump peek step1
        ssl_bump bump all
        tls_outgoing_options cafile={upstream_ca}
        pid_filename {d}/squid.pid
        cache_log {d}/cache.log
        access_log none
        cache deny all
        coredump_dir {d}
        hosts_file {d}/hosts
        shutdown_lifetime 0 seconds
        acl bench_host dstdomain {host}
        acl CONNECT method CONNECT
        http_access allow CONNECT bench_host
        http_access allow bench_host
        http_access deny all
        """
    )


def start(
    listen: str, upstream_ca: str, host: str, address: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """Squid (ssl-bump) listening on `listen` for `host` at `address`; returns the
    process and its directory (`ca.pem` there is the CA its clients must trust; the
    caller removes it). Squid started as root serves as the `proxy` user, so the
    directory is a new one in /tmp that user may enter, its files world-readable
    (bench-only keys)."""
    import trustme

    root = unpacked()
    d = Path(tempfile.mkdtemp(prefix="stockade-squid-bump-"))
    d.chmod(0o777)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    ca.private_key_pem.write_to_path(str(d / "ca.key"))
    (d / "hosts").write_text(f"{address} {host}\n")
    # a copy: the original may sit in a directory the `proxy` user cannot enter
    shutil.copyfile(upstream_ca, d / "upstream-ca.pem")
    (d / "squid.conf").write_text(config(d, listen, root, str(d / "upstream-ca.pem"), host))
    for f in d.iterdir():
        f.chmod(0o644)
    certgen = root / "usr" / "lib" / "squid" / "security_file_certgen"
    subprocess.run(
        [str(certgen), "-c", "-s", str(d / "ssl_db"), "-M", "4MB"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    if _has_user("proxy"):  # the certificate helper runs as Squid's user
        for p in [d / "ssl_db", *(d / "ssl_db").rglob("*")]:
            shutil.chown(p, "proxy", "proxy")
    proc = subprocess.Popen(
        [str(root / "usr" / "sbin" / "squid"), "-N", "-f", str(d / "squid.conf")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, d


def log_tail(d: Path, lines: int = 5) -> str:
    """The end of Squid's cache.log (why it stopped), for an error message."""
    try:
        return " | ".join((d / "cache.log").read_text().splitlines()[-lines:])
    except OSError as e:
        return f"(no cache.log: {e.strerror})"


def _has_user(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
