"""The fake internet: test hosts in network namespaces, for every test suite and the demo.

`FakeInternet` builds a namespace with DNS, HTTP/HTTPS sites, a PEP 503 index, a demo
API and TCP/UDP echo; `ClientNamespace` builds a sandbox stand-in whose traffic nft
redirects to host ports. See docs/testnet.md.
"""

from stockade.testing.testnet.client import ClientNamespace, nft_ruleset
from stockade.testing.testnet.host import TestnetError, available, reap_stale
from stockade.testing.testnet.internet import DEFAULT_API_KEY, FakeInternet
from stockade.testing.testnet.layout import Layout, plan
from stockade.testing.testnet.zone import Record

__all__ = [
    "DEFAULT_API_KEY",
    "ClientNamespace",
    "FakeInternet",
    "Layout",
    "Record",
    "TestnetError",
    "available",
    "nft_ruleset",
    "plan",
    "reap_stale",
]
