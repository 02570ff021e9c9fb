"""The `gateway:` section of stockade.yaml."""

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stockade.listen import DnsServerAddress, ListenAddress
from stockade.tcp import CONGESTION_CONTROL_NAME


class InspectionSettings(BaseModel):
    """L7 inspection (mitmproxy) of TLS flows whose allow entries have an `http:` block."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # run the inspector child process; off: such flows stay denied `inspection_unavailable`
    enabled: bool = True
    # where the inspector listens: loopback only (the gateway is its only client, and each
    # hand-off is signed with a per-start key); port 0 = any free port
    listen: ListenAddress = "127.0.0.1:0"
    # extra CA bundle (PEM) trusted for upstream certificates, on top of the system CAs
    # (default: the top-level upstream_ca_file)
    upstream_ca_file: str | None = None
    system_ca_dir: str | None = "/etc/ssl/certs"  # the system CAs (hashed dir); None: certifi
    # the inspector's CA (key 0600), made once; default: <state_dir>/gateway/inspector-ca
    ca_dir: str | None = None
    handoff_timeout_s: float = Field(5.0, gt=0)  # connect + CONNECT answer from the inspector
    # once the client's SNI names the flow's host, dial the checked address and finish the
    # upstream TLS before answering the client's: the client is offered only the ALPN the
    # upstream chose, so an HTTP/2 client of an HTTP/1.1-only upstream speaks HTTP/1.1 over
    # one reused upstream connection (off: mitmproxy opens a new upstream connection per
    # HTTP/2 request, 3x slower, bench/README.md "Inspected path", and rewrites each HTTP/2
    # head into HTTP/1.1). Off: nothing is dialled before the client's first request, so a
    # denied first request costs no upstream connection
    upstream_first: bool = True
    start_timeout_s: float = Field(30.0, gt=0)  # from spawn to "ready" before it is restarted
    restart_delay_s: float = Field(0.5, gt=0)  # first delay before a restart; doubles per failure
    restart_delay_max_s: float = Field(10.0, gt=0)  # ... up to this
    # a child that stays up this long after ready counts as healthy: the next restart
    # delay starts from restart_delay_s again (a crash loop keeps doubling it)
    stable_after_s: float = Field(30.0, gt=0)
    # liveness: a probe hand-off every health_interval_s; a child that does not answer
    # within health_timeout_s, health_failures times in a row, is killed and restarted
    health_interval_s: float = Field(5.0, gt=0)
    health_timeout_s: float = Field(5.0, gt=0)  # connect + answer of one liveness probe
    health_failures: int = Field(2, ge=1)  # missed probes in a row before a restart

    @field_validator("listen")
    @classmethod
    def _loopback_only(cls, v: str) -> str:
        host = v.rpartition(":")[0].strip("[]")
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError("must be a loopback address (sandboxes must never reach it)")
        return v


class GatewaySettings(BaseModel):
    """The per-task upload cap is not here: it is the profile's `limits.egress_bytes`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transparent_listen: list[ListenAddress] = ["0.0.0.0:15001"]
    proxy_listen: list[ListenAddress] = ["127.0.0.1:3128"]
    control_socket: str = "/run/stockade/gateway.sock"  # control API; <run_dir>/gateway.sock
    metrics_listen: ListenAddress = "127.0.0.1:9464"
    resolvers: list[DnsServerAddress] = ["127.0.0.53"]  # upstream DNS servers, "ip" or "ip:port"
    allow_addresses: list[str] = []  # CIDRs exempt from the special-purpose check
    sniff_timeout_s: float = Field(5.0, gt=0)
    sniff_max_bytes: int = Field(16384, ge=1024)
    connect_timeout_s: float = Field(10.0, gt=0)
    idle_timeout_s: float = Field(300.0, gt=0)
    max_connections_per_task: int = Field(256, ge=1)
    uvloop: bool = True  # gateway and inspector child on uvloop when installed (it is by default)
    splice: bool = True  # zero-copy relay with os.splice where the kernel allows it
    # TCP congestion control of the client-side connections (set on both listeners, which
    # the accepted sockets inherit). Their clients are the sandboxes on this host, where a
    # pacing algorithm such as bbr only adds timers (in bench/gateway_bench.py it cut a
    # tunnel's download to a third); a proxy_listen exposed to other hosts' clients gets it
    # too. None keeps the system default; the upstream side always does.
    sandbox_congestion_control: str | None = Field("cubic", pattern=CONGESTION_CONTROL_NAME)
    rules_poll_interval_s: float = Field(2.0, gt=0)  # rule file change detection (mtime/size)
    own_addresses: list[str] = []  # extra addresses/CIDRs of this host, never dialled
    detect_own_addresses: bool = True  # add every non-loopback interface address (`ip -j addr`)
    registry_file: str | None = None  # default: <state_dir>/gateway-tasks.json
    max_open_files: int = Field(1048576, ge=1024)  # RLIMIT_NOFILE raised towards this at start
    inspection: InspectionSettings = InspectionSettings()
