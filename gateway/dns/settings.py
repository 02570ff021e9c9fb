"""The `dns:` section of stockade.yaml (the DNS firewall inside the gateway)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DnsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: list[str] = ["0.0.0.0:15053"]
    deny_rcode: Literal["REFUSED", "NXDOMAIN"] = "REFUSED"
    ttl_min_s: int = Field(5, ge=0)
    ttl_max_s: int = Field(300, ge=1)
    max_name_length: int = Field(253, ge=1, le=253)
    max_label_length: int = Field(63, ge=1, le=63)
    queries_per_second: float = Field(50.0, gt=0)
    query_burst: int = Field(100, ge=1)
    unresolvable_names_per_minute: int = Field(20, ge=1)
    entropy_threshold_bits: float = Field(4.0, gt=0)
    entropy_min_label_length: int = Field(16, ge=1)
