"""The inspection CA inside a sandbox: the trust bundle file and the variables naming it.

Pure apart from writing one file: `write_trust_bundle(config, etc_dir)` puts the bundle
(the host's public CAs, then the gateway's inspection CA: `stockade.trust.trust_bundle`)
into the sandbox's generated etc directory as TRUST_BUNDLE_NAME, root-owned and 0644 (the
sandbox reads it through a read-only bind or share, it can never change it), and returns
that name with the environment (`stockade.trust.trust_env`) pointing every client at
`/etc/<name>`. With inspection disabled it writes nothing and returns None: no flow is
ever intercepted, so sandboxes keep the upstreams' own certificates.

Public CAs come first so uninspected flows (entries without `http:`) keep verifying the
upstream's own certificate; the inspection CA is what inspected flows present.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from stockade.trust import inspection_ca_cert, trust_bundle, trust_env

TRUST_BUNDLE_NAME = "stockade-ca-bundle.pem"
# the system's default bundle (relative to /etc) that the launcher puts the bundle over
# when the sandbox's /etc has it: curl, git, OpenSSL and Debian's requests and pip read it
DEFAULT_BUNDLE = "ssl/certs/ca-certificates.crt"
SANDBOX_ETC = "/etc"


def write_trust_bundle(
    config: Any,
    etc_dir: str | os.PathLike[str],
    system_bundle: str | None = None,
    sandbox_dir: str = SANDBOX_ETC,
) -> tuple[str, dict[str, str]] | None:
    """Write `<etc_dir>/TRUST_BUNDLE_NAME` and return (TRUST_BUNDLE_NAME, env), or None
    when `config.gateway.inspection.enabled` is off. The env points at
    `<sandbox_dir>/TRUST_BUNDLE_NAME` (default /etc: where the generated etc files are
    bound). `config` is a stockade.config.Config;
    the inspection CA is created if the gateway has not made it yet (the gateway reuses
    it). The file is replaced atomically (a sandbox never sees half a bundle) and never
    written through a symlink."""
    if not sandbox_dir.startswith("/") or sandbox_dir != os.path.normpath(sandbox_dir):
        raise ValueError(f"sandbox_dir must be a normalised absolute path: {sandbox_dir!r}")
    if not config.gateway.inspection.enabled:
        return None
    data = trust_bundle(inspection_ca_cert(config), system_bundle)
    directory = Path(etc_dir)
    fd, tmp = tempfile.mkstemp(prefix=f".{TRUST_BUNDLE_NAME}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), 0o644)
            if os.geteuid() == 0:
                os.fchown(f.fileno(), 0, 0)
        os.replace(tmp, directory / TRUST_BUNDLE_NAME)  # replaces a symlink, never follows it
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return TRUST_BUNDLE_NAME, trust_env(f"{sandbox_dir.rstrip('/')}/{TRUST_BUNDLE_NAME}")
