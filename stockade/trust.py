"""The inspection CA and how a sandbox comes to trust it.

The gateway's inspector makes the CA (`ensure_ca`, files in the state dir) and the
launcher writes the bundle a sandbox trusts (`trust_bundle`, `trust_env`): both read the
same names from here, so neither component imports the other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# mitmproxy's CertStore file names (its TlsConfig opens <confdir>/mitmproxy-ca.pem): the
# key + certificate in mitmproxy-ca.pem (0600), the certificate alone in -ca-cert.pem;
# the CA itself is named "Stockade inspection CA"
CA_BASENAME = "mitmproxy"


def ca_dir(state_dir: str | os.PathLike[str], configured: str | None = None) -> Path:
    return Path(configured) if configured else Path(state_dir) / "gateway" / "inspector-ca"


def ca_cert_file(directory: Path) -> Path:
    """The CA certificate sandboxes must trust (PEM, no key)."""
    return directory / f"{CA_BASENAME}-ca-cert.pem"


def ensure_ca(directory: Path) -> Path:
    """Create the inspector's CA once (key files 0600) and return the path of its
    certificate. A missing directory is made 0700; an existing one (an operator's
    `ca_dir`) keeps its mode and owner: it is never loosened. An existing CA is reused,
    so sandboxes keep trusting it across gateway restarts."""
    if not directory.is_dir():
        directory.mkdir(parents=True, mode=0o700, exist_ok=True)
    key_file = directory / f"{CA_BASENAME}-ca.pem"
    if not key_file.exists():
        from mitmproxy.certs import CertStore  # only where a CA is actually made

        CertStore.create_store(
            directory, CA_BASENAME, 2048, organization="Stockade", cn="Stockade inspection CA"
        )
    for secret in directory.glob(f"{CA_BASENAME}-ca.*"):  # the key and its PKCS12 copy
        os.chmod(secret, 0o600)
    return ca_cert_file(directory)


def inspection_ca_cert(config: Any) -> Path:
    """For the launcher: the PEM file sandboxes must trust for inspected flows (created
    if missing). `config` is a stockade.config.Config."""
    insp = config.gateway.inspection
    return ensure_ca(ca_dir(config.state_dir, insp.ca_dir))


# what a sandbox needs to trust the inspection CA: a bundle with the public CAs (for
# uninspected flows, which keep the upstream's own certificate) and the inspection CA. The
# launcher also puts it over the system's default bundle path (curl, git, OpenSSL, Debian's
# requests and pip read that). Only variables that never override a CA a tool was given
# explicitly: requests reads REQUESTS_CA_BUNDLE and CURL_CA_BUNDLE even when its caller
# passed verify=<file> (so `pip --cert` stops working), and GIT_SSL_CAINFO beats
# git config's http.sslCAInfo
TRUST_ENV_VARS = (
    "SSL_CERT_FILE",  # OpenSSL's default file (Python ssl's default context, Ruby, ...)
    "PIP_CERT",  # pip with its own certifi (a venv's pip); `pip --cert` still wins
    "NODE_EXTRA_CA_CERTS",  # node/npm (adds to its built-in CAs)
)
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
)


def trust_bundle(ca_cert: str | os.PathLike[str], system_bundle: str | None = None) -> bytes:
    """The PEM bundle a sandbox should trust: the system's CAs, then the inspection CA.
    `system_bundle` defaults to the first of SYSTEM_BUNDLES that exists (else certifi's)."""
    if system_bundle is None:
        system_bundle = next((p for p in SYSTEM_BUNDLES if os.path.exists(p)), None)
    if system_bundle is None:
        import certifi

        system_bundle = certifi.where()
    public = Path(system_bundle).read_bytes()
    if public and not public.endswith(b"\n"):
        public += b"\n"
    return public + Path(ca_cert).read_bytes()


def trust_env(bundle_path: str) -> dict[str, str]:
    """The environment that points every client in TRUST_ENV_VARS at `bundle_path` (a
    path as the sandbox sees it)."""
    return dict.fromkeys(TRUST_ENV_VARS, bundle_path)
