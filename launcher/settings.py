"""The `launcher:` section of stockade.yaml."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LauncherSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["netns", "qemu-microvm"] = "netns"
    address_pool: str = "10.213.0.0/16"  # carved into one /30 per sandbox
    control_socket: str = "/run/stockade/launcher.sock"
    scratch_dir: str = "/var/lib/stockade/sandboxes"
    nft_table: str = "stockade"
    nflog_group: int = Field(7413, ge=0, le=65535)
    default_ttl_s: int = Field(300, ge=1)
