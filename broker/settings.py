"""The `broker:` and `vault:` sections of stockade.yaml."""

from pydantic import BaseModel, ConfigDict, Field


class BrokerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: str = "0.0.0.0:8081"
    control_socket: str = "/run/stockade/broker.sock"
    metrics_listen: str = "127.0.0.1:9465"
    secret_cache_ttl_s: float = Field(60.0, gt=0)
    serve_stale_s: float = Field(300.0, ge=0)
    upstream_timeout_s: float = Field(30.0, gt=0)
    ca_file: str | None = None  # extra CA bundle for upstream APIs (tests, private CAs)
    # largest request the HTTP server accepts at all (the profile's max_body is usually lower)
    max_request_bytes: int = Field(16 * 2**20, gt=0)
    # /v1/call buffers the upstream response into its JSON answer: cap it
    max_call_response_bytes: int = Field(10 * 2**20, gt=0)
    # a gzip/deflate upstream body is decoded (for scrubbing) up to this many bytes
    max_decoded_bytes: int = Field(256 * 2**20, gt=0)
    max_upstream_connections: int = Field(256, ge=1)  # pooled connections to all upstreams
    # pinned upstream addresses {name: ip} (fake internet, private APIs); others use DNS
    hosts: dict[str, str] = {}
    state_file: str | None = None  # task registry state; default <state_dir>/broker-tasks.json


class AppRoleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role_id_file: str
    secret_id_file: str
    secret_id_wrapped: bool = False
    mount: str = "approle"


class VaultSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = None  # None: `stockade run`/`up` start a dev OpenBao
    token_file: str | None = None
    approle: AppRoleSettings | None = None
    ca_file: str | None = None
    timeout_s: float = Field(5.0, gt=0)
