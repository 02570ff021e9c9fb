"""launcher/trust.py: the trust bundle written into a sandbox's generated etc dir (no
sandbox is booted)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from stockade.gateway.settings import GatewaySettings, InspectionSettings
from stockade.launcher.trust import TRUST_BUNDLE_NAME, write_trust_bundle

from stockade.config import Config
from stockade.trust import TRUST_ENV_VARS, ca_cert_file, ca_dir

PUBLIC = b"-----BEGIN CERTIFICATE-----\nPUBLIC\n-----END CERTIFICATE-----"  # no newline


def _config(tmp: Path, **inspection: object) -> Config:
    return Config(
        state_dir=str(tmp / "state"),
        gateway=GatewaySettings(
            inspection=InspectionSettings(ca_dir=str(tmp / "ca"), **inspection)  # type: ignore[arg-type]
        ),
    )


@pytest.fixture
def system_bundle(tmp_path: Path) -> str:
    p = tmp_path / "system.pem"
    p.write_bytes(PUBLIC)
    return str(p)


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    """The sandbox's /etc on the host: empty."""
    d = tmp_path / "etc"
    d.mkdir()
    return d


def test_the_bundle_is_written_root_owned_0644_with_the_env(
    tmp_path: Path, etc: Path, system_bundle: str
) -> None:
    cfg = _config(tmp_path)
    out = write_trust_bundle(cfg, etc, system_bundle)
    assert out is not None
    name, env = out
    assert name == TRUST_BUNDLE_NAME and "/" not in name
    assert set(env) == set(TRUST_ENV_VARS)
    assert set(env.values()) == {f"/etc/{TRUST_BUNDLE_NAME}"}
    f = etc / name
    st = f.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (0, 0)
    data = f.read_bytes()
    ca = ca_cert_file(ca_dir(cfg.state_dir, cfg.gateway.inspection.ca_dir)).read_bytes()
    assert data == PUBLIC + b"\n" + ca  # public CAs first, then the inspection CA
    assert b"PRIVATE KEY" not in data
    assert sorted(p.name for p in etc.iterdir()) == [name]  # no temporary file left


def test_disabled_inspection_writes_nothing(
    tmp_path: Path, etc: Path, system_bundle: str
) -> None:
    assert write_trust_bundle(_config(tmp_path, enabled=False), etc, system_bundle) is None
    assert list(etc.iterdir()) == []
    assert not (tmp_path / "ca").exists()  # no CA made either


def test_an_existing_file_or_symlink_is_replaced_not_followed(
    tmp_path: Path, etc: Path, system_bundle: str
) -> None:
    cfg = _config(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (etc / TRUST_BUNDLE_NAME).symlink_to(victim)
    write_trust_bundle(cfg, etc, system_bundle)
    assert victim.read_bytes() == b"keep"
    assert not (etc / TRUST_BUNDLE_NAME).is_symlink()
    first = (etc / TRUST_BUNDLE_NAME).read_bytes()
    write_trust_bundle(cfg, etc, system_bundle)  # again: same CA, same bundle
    assert (etc / TRUST_BUNDLE_NAME).read_bytes() == first


def test_another_in_sandbox_directory(tmp_path: Path, etc: Path, system_bundle: str) -> None:
    out = write_trust_bundle(_config(tmp_path), etc, system_bundle, sandbox_dir="/sbx/trust")
    assert out is not None
    assert set(out[1].values()) == {f"/sbx/trust/{TRUST_BUNDLE_NAME}"}
    for bad in ("relative", "/a/../b", "/a/"):
        with pytest.raises(ValueError):
            write_trust_bundle(_config(tmp_path), etc, system_bundle, sandbox_dir=bad)
