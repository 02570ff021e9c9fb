"""Compatibility shim: the address registry lives in `stockade.net.addresses` (issue #14)."""

from stockade.net.addresses import (
    METADATA_ADDRESSES,
    SPECIAL_PURPOSE,
    AddressPolicy,
    IPAddress,
    IPNetwork,
    embedded_ipv4,
    parse_address,
)

__all__ = [
    "METADATA_ADDRESSES",
    "SPECIAL_PURPOSE",
    "AddressPolicy",
    "IPAddress",
    "IPNetwork",
    "embedded_ipv4",
    "parse_address",
]
