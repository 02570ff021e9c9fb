"""The `dns:` section of stockade.yaml (the DNS firewall inside the gateway)."""

from dataclasses import fields
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from stockade.listen import ListenAddress

V = TypeVar("V")


class DnsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # DNS firewall listeners (UDP and TCP); nft redirects sandbox port 53 here
    listen: list[ListenAddress] = ["0.0.0.0:15053"]
    # answer for a denied name: REFUSED or NXDOMAIN
    deny_rcode: Literal["REFUSED", "NXDOMAIN"] = "REFUSED"
    # answer/cache TTLs are clamped to at least this (also holds a rebinding name)
    ttl_min_s: int = Field(5, ge=0)
    ttl_max_s: int = Field(300, ge=1)  # and at most this
    # longer query names are refused (name_too_long)
    max_name_length: int = Field(253, ge=1, le=253)
    max_label_length: int = Field(63, ge=1, le=63)  # longer labels are refused (label_too_long)
    queries_per_second: float = Field(50.0, gt=0)  # per-task query rate (token bucket refill)
    query_burst: int = Field(100, ge=1)  # per-task query burst (token bucket size)
    # distinct NXDOMAIN names per task and allowed suffix per minute
    unresolvable_names_per_minute: int = Field(20, ge=1)
    # name budgets (names under wildcard allow entries, resolved or not): the sliding window
    name_budget_window_s: float = Field(600.0, gt=0)
    # distinct names per task and wildcard allow entry per window (name_budget_exceeded)
    wildcard_names_per_window: int = Field(64, ge=1)
    # bytes of distinct wildcard names per task per window (name_budget_exceeded)
    name_bytes_per_window: int = Field(4096, ge=253)
    # distinct wildcard names with an encoded-looking label per task per window
    encoded_names_per_window: int = Field(16, ge=1)
    # labels at least this long are checked for hex/base32/base64 alphabets
    encoded_min_label_length: int = Field(10, ge=4, le=63)
    # labels above this Shannon entropy (bits/char) are refused
    entropy_threshold_bits: float = Field(4.0, gt=0)
    # entropy is judged only on labels at least this long
    entropy_min_label_length: int = Field(16, ge=1)
    edns_udp_payload: int = Field(1232, ge=512, le=4096)  # buffer size we advertise in OPT
    log_allowed: bool = False  # also emit an event for every answered query (costs ~50 us each)
    tcp_idle_timeout_s: float = Field(10.0, gt=0)  # close idle DNS-over-TCP connections
    max_tcp_connections: int = Field(256, ge=1)  # concurrent DNS-over-TCP connections
    # concurrent DNS-over-TCP connections per source address (one task's share)
    max_tcp_connections_per_task: int = Field(16, ge=1)
    max_pending: int = Field(1024, ge=1)  # upstream lookups in flight; beyond it: SERVFAIL


def settings_view(view: type[V], settings: DnsSettings, **renamed: str) -> V:
    """The dataclass `view` filled from `settings`: each field from the setting of the same
    name, or of the name `renamed` gives it. (The guards keep small frozen records of their
    own: `name_violation` caches on them, and the tests build them without the model.)"""
    names = fields(view)  # type: ignore[arg-type]
    return view(**{f.name: getattr(settings, renamed.get(f.name, f.name)) for f in names})
