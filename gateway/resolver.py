"""Compatibility shim: the resolver lives in `stockade.net.resolver` (issue #14)."""

from stockade.net.resolver import Resolution, Resolver, normalize_name, parse_server

__all__ = ["Resolution", "Resolver", "normalize_name", "parse_server"]
