"""The `broker:` and `vault:` sections of stockade.yaml."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stockade.listen import ListenAddress, OptionalListenAddress
from stockade.tcp import CONGESTION_CONTROL_NAME


class BrokerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # the broker's HTTP listener (sandboxes reach it; nft scopes who can)
    listen: ListenAddress = "0.0.0.0:8081"
    # control API (task registry, reload), a Unix socket created mode 0600; default
    # <run_dir>/broker.sock
    control_socket: str = "/run/stockade/broker.sock"
    # Prometheus /metrics; keep it on a host-only address
    metrics_listen: OptionalListenAddress = "127.0.0.1:9465"
    secret_cache_ttl_s: float = Field(60.0, gt=0)  # how long a secret read from Vault is reused
    # after a failed Vault read, a cached secret is served this long, then 503
    serve_stale_s: float = Field(300.0, ge=0)
    upstream_timeout_s: float = Field(30.0, gt=0)  # total timeout of one upstream API call
    # extra CA bundle for upstream APIs (tests, private CAs); default: upstream_ca_file
    ca_file: str | None = None
    # largest request the HTTP server accepts at all (the profile's max_body is usually lower)
    max_request_bytes: int = Field(16 * 2**20, gt=0)
    # /v1/call buffers the upstream response into its JSON answer: cap it
    max_call_response_bytes: int = Field(10 * 2**20, gt=0)
    # a gzip/deflate upstream body is decoded (for scrubbing) up to this many bytes
    max_decoded_bytes: int = Field(256 * 2**20, gt=0)
    max_upstream_connections: int = Field(256, ge=1)  # pooled connections to all upstreams
    request_header_timeout_s: float = Field(10.0, gt=0)  # deadline for a whole request head (408)
    request_body_timeout_s: float = Field(60.0, gt=0)  # deadline for a whole request body (408)
    keepalive_timeout_s: float = Field(75.0, gt=0)  # idle keep-alive connections close after this
    max_request_line_bytes: int = Field(8190, ge=256)  # longest request line; longer: 431
    max_header_field_bytes: int = Field(8190, ge=256)  # longest header name or value; longer: 431
    max_header_count: int = Field(100, ge=8)  # most header lines in one request; more: 431
    max_concurrent_calls_per_task: int = Field(32, ge=1)  # in-flight calls per task; more: 429
    # request body bytes one task's calls hold in memory at once; more: 429 body_memory_limit
    max_body_bytes_in_flight_per_task: int = Field(16 * 2**20, ge=64 * 1024)
    # TCP congestion control of the connections sandboxes open (set on the listener, which
    # they inherit): a host-local leg, where a pacing algorithm such as bbr only adds
    # timers. None keeps the system default; upstream API calls always do.
    sandbox_congestion_control: str | None = Field("cubic", pattern=CONGESTION_CONTROL_NAME)
    # pinned upstream addresses {name: ip} (fake internet, private APIs); others use DNS
    hosts: dict[str, str] = {}
    state_file: str | None = None  # task registry state; default <state_dir>/broker-tasks.json
    # rule file change detection (mtime/size, as gateway.rules_poll_interval_s): a changed
    # rules directory (a kubelet ConfigMap swap too) is reloaded like SIGHUP does
    rules_poll_interval_s: float = Field(2.0, gt=0)


class AppRoleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role_id_file: str
    secret_id_file: str
    secret_id_wrapped: bool = False
    mount: str = "approle"


SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"  # noqa: S105


class KubernetesAuthSettings(BaseModel):
    """`vault.kubernetes`: Vault's Kubernetes auth method, logged in with the pod's token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str = Field(min_length=1)  # the Vault role bound to the pod's service account
    mount: str = Field("kubernetes", min_length=1)  # where the auth method is mounted
    # the service-account token; read again at every login (the kubelet rotates it)
    token_file: str = SERVICE_ACCOUNT_TOKEN


VaultAuth = Literal["token", "approle", "kubernetes"]


class VaultSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = None  # None: `stockade run`/`up` start a dev OpenBao
    # how the broker logs in: token (token_file), approle (vault.approle) or kubernetes
    # (vault.kubernetes); unset: token when token_file is set, else approle
    auth: VaultAuth | None = None
    token_file: str | None = None  # file holding a Vault token (auth: token)
    approle: AppRoleSettings | None = None
    kubernetes: KubernetesAuthSettings | None = None
    ca_file: str | None = None  # CA bundle to verify the Vault server's certificate
    timeout_s: float = Field(5.0, gt=0)  # timeout of one Vault request

    @model_validator(mode="after")
    def _auth_has_its_settings(self) -> "VaultSettings":
        needs = {"token": ("token_file", self.token_file), "approle": ("approle", self.approle),
                 "kubernetes": ("kubernetes", self.kubernetes)}
        if self.auth is not None and needs[self.auth][1] is None:
            raise ValueError(f"auth: {self.auth} needs vault.{needs[self.auth][0]}")
        if self.kubernetes is not None and self.auth != "kubernetes":
            raise ValueError("vault.kubernetes is set: also set auth: kubernetes")
        return self

    @property
    def auth_mode(self) -> VaultAuth | None:
        """The login in force: `auth`, else what today's settings imply (None: none set)."""
        if self.auth is not None:
            return self.auth
        if self.token_file:
            return "token"
        return "approle" if self.approle is not None else None


class DevSecret(BaseModel):
    """One secret the embedded dev OpenBao is given at start (KV v2 under `secret/`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
    field: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    # a file holding the value (one trailing newline dropped): never the value itself, so
    # it stays out of the config, argv and `ps`
    file: str = Field(min_length=1)

    @field_validator("path")
    @classmethod
    def _no_dot_segments(cls, v: str) -> str:
        if {".", ".."} & set(v.split("/")):
            raise ValueError("no '.' or '..' segments")
        return v


class DevVaultSettings(BaseModel):
    """The dev OpenBao that `stockade run`/`up` start when `vault.address` is unset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # false: no dev OpenBao and, without vault.address, no Vault at all: the broker serves
    # no credential (a call that needs one is refused vault_unavailable). `stockade run`
    # sets it for a stack of its own when no profile of its rules has a broker grant
    enabled: bool = True
    port: int | None = Field(None, ge=1, le=65535)  # loopback port; default base_port+6, else free
    # secrets put at start ({path, field, file}), e.g. the keys the profiles' broker grants use
    secrets: list[DevSecret] = []
