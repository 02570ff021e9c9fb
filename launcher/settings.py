"""The `launcher:` section of stockade.yaml."""

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stockade.events.probemark import ProbeWindow, window_of
from stockade.tcp import CONGESTION_CONTROL_NAME

from .initscript import check_etc_entry


class MicrovmSettings(BaseModel):
    """`launcher.microvm`: the QEMU microVM backend of `isolation: microvm` profiles."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # false: microvm profiles are refused (or downgraded, see downgrade_isolation)
    enabled: bool = True
    # kernel + initramfs built by vm-images/build.sh (scripts/bootstrap.sh runs it)
    image_dir: str = "/var/cache/stockade/vm"
    qemu: str = "qemu-system-x86_64"  # the QEMU binary (PATH lookup)
    # kvm, tcg (software emulation: slower, works everywhere), or auto: one probe boot with
    # KVM (cached per kernel/image/QEMU in state_dir) decides; tcg when /dev/kvm is unusable
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    probe_timeout_s: float = Field(10.0, gt=0)  # the auto probe's boot must end within this
    # guest RAM = the profile's memory + this (the guest kernel's own share; the command's
    # cgroup inside the guest gets exactly the profile's memory)
    guest_kernel_mib: int = Field(64, ge=16)
    # the host cgroup holds QEMU: guest RAM + this + the profile's disk (scratch pages are
    # charged to QEMU, who writes them for the guest) + tb_size_mib unless accel is kvm
    vmm_overhead_mib: int = Field(192, ge=32)
    # pids limit of the host cgroup (QEMU's threads); the profile's pids apply in the guest
    vmm_pids: int = Field(512, ge=32)
    # TCG translation cache (QEMU's default is 1 GiB); QEMU 10's position-independent
    # translations are reused across execs, which 64 MiB flushed (bench/README.md)
    tb_size_mib: int = Field(256, ge=8)
    # QEMU's seccomp filter (-sandbox) and dropping to sandbox_uid/gid once set up
    harden_qemu: bool = True
    # snapshot starts: a machine shape's first cold boot builds its template (in the
    # background; a warm pool's refill builds it first), later guests restore from it;
    # a corrupt or refused template is removed and that start boots cold (an event says so)
    snapshots: bool = True
    # commands a pooled guest runs once before its claim, as the sandbox user with nothing
    # of a task (stdio /dev/null, killed after 10 s), so that a claim's command start finds
    # their code translated and cached (under TCG a first start of bash costs ~60 ms more);
    # absolute paths in the guest (its /usr is the host's); [] runs none
    pool_warmup: list[list[str]] = [["/usr/bin/bash", "-c", ":"]]

    @field_validator("pool_warmup")
    @classmethod
    def _warmup_argvs(cls, v: list[list[str]]) -> list[list[str]]:
        for argv in v:
            if not argv or not argv[0].startswith("/") or any("\0" in a for a in argv):
                raise ValueError("each warm-up command is an argv whose first item is an "
                                 "absolute path")
        return v


class GvisorSettings(BaseModel):
    """`launcher.gvisor`: the runsc backend of `isolation: gvisor` profiles."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # false: gvisor profiles are refused (or downgraded, see downgrade_isolation)
    enabled: bool = True
    runsc: str = "runsc"  # the runsc binary (PATH lookup)
    # auto: systrap when the installed runsc has it, else ptrace; kvm only when asked
    # for and a probe run ends within probe_timeout_s (it hangs on hosts without nested KVM)
    platform: Literal["auto", "systrap", "ptrace", "kvm"] = "auto"
    # sandbox: gVisor's own netstack; host: the Sentry's sockets are host sockets inside
    # the sandbox's own netns (the nft fence unchanged); auto: one probe run in a throwaway
    # netns per launcher process decides (sandbox where it starts, else host)
    network: Literal["auto", "sandbox", "host"] = "auto"
    # runsc's state (one directory per nft_table below this; a tmpfs such as /run)
    root_dir: str = "/run/stockade/runsc"
    # the host memory cgroup holds the Sentry and the gofer too (idle: 13-19 MiB)
    memory_overhead_mib: int = Field(64, ge=16)
    # host pids.max = 2 x the profile's pids + this: under systrap every guest process has
    # a host stub, and runsc's Go runtimes need their threads (the profile's pids are the
    # guest's RLIMIT_NPROC, counted by the Sentry)
    pids_overhead: int = Field(128, ge=64)
    probe_timeout_s: float = Field(10.0, gt=0)  # the network and kvm probes end within this
    debug_log_dir: str | None = None  # runsc --debug logs here (slower starts)


class PoolTarget(BaseModel):
    """One warm pool: sandboxes of one tier and resource shape kept ready for a claim. A
    task uses it when its profile's tier and limits (cpus, memory, disk, pids) are exactly
    these; its TTL starts at the claim."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    isolation: Literal["container", "gvisor", "microvm"] = "container"
    size: int = Field(ge=1, le=1000)  # sandboxes kept ready (each holds its shape's memory)
    cpus: float = Field(1.0, gt=0)
    memory_mib: int = Field(512, ge=16)
    disk_mib: int = Field(1024, ge=1)  # the scratch tmpfs
    pids: int = Field(256, ge=16)


class PoolSettings(BaseModel):
    """`launcher.pools`: warm pools, kept by the launcher service (`stockade up`); a
    one-shot `stockade run` without a running stack keeps none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    targets: list[PoolTarget] = []
    # pooled sandboxes being made at once, over all pools (each start is mostly mount and
    # netns syscalls: more than the host's cores only queues them)
    refill_concurrency: int = Field(2, ge=1, le=64)

    @field_validator("targets")
    @classmethod
    def _one_per_shape(cls, v: list[PoolTarget]) -> list[PoolTarget]:
        seen: set[tuple[object, ...]] = set()
        for t in v:
            key = (t.isolation, t.cpus, t.memory_mib, t.disk_mib, t.pids)
            if key in seen:
                raise ValueError(f"two pools of one tier and shape: {t.isolation} "
                                 f"cpus={t.cpus} memory_mib={t.memory_mib} "
                                 f"disk_mib={t.disk_mib} pids={t.pids} (give one its size)")
            seen.add(key)
        return v


class SelftestSettings(BaseModel):
    """`launcher.selftest`: the probes each sandbox's fence must fail before its command
    starts (launcher/selftest.py). The target addresses are never dialled past the fence:
    a fence that holds redirects or rejects them on this host. The defaults are RFC 5737 /
    RFC 3849 documentation addresses, which no network routes; tests and the demo point
    them at addresses of the fake internet's namespace."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # share of the starts of `selftest: sampled` profiles that run it (0.0 to 1.0);
    # `selftest: required` profiles (the default) run it on every start
    sample_rate: float = Field(1.0, ge=0.0, le=1.0)
    raw_ip: str = "192.0.2.1"  # a raw IPv4 destination (TLS without a name, UDP, ports)
    outside_resolver: str = "192.0.2.53"  # a resolver other than the DNS firewall
    ipv6_address: str = "2001:db8::1"  # an IPv6 destination
    # each probe's own deadline (seconds): a probe that hangs fails
    probe_timeout_s: float = Field(2.0, gt=0, le=30)
    # how long the events of the probes (gateway, DNS firewall, NFLOG reader) may take to
    # reach the task's event store: the wait ends as soon as they are in, so this only
    # bounds a broken fence's report, and a busy node must not fail a holding fence
    evidence_timeout_s: float = Field(10.0, gt=0, le=30)

    def window(self) -> ProbeWindow:
        """Where and when the probes go: the event throttle recognises the events that
        cannot name a marker by it (stockade/events/summary.py)."""
        return window_of(self)

    @field_validator("raw_ip", "outside_resolver")
    @classmethod
    def _ipv4(cls, v: str) -> str:
        return str(ipaddress.IPv4Address(v))

    @field_validator("ipv6_address")
    @classmethod
    def _ipv6(cls, v: str) -> str:
        return str(ipaddress.IPv6Address(v))


class LauncherSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # backend of `isolation: container` profiles (the netns backend, container grade);
    # `isolation: microvm` profiles run in the microVM backend (launcher.microvm),
    # `isolation: gvisor` ones under runsc (launcher.gvisor)
    backend: Literal["netns"] = "netns"
    microvm: MicrovmSettings = MicrovmSettings()
    gvisor: GvisorSettings = GvisorSettings()
    pools: PoolSettings = PoolSettings()
    selftest: SelftestSettings = SelftestSettings()
    # A profile whose `isolation` asks for a tier this host cannot give (gvisor:
    # launcher.gvisor disabled or runsc missing; microvm: launcher.microvm disabled, QEMU or
    # the image missing) is refused, unless its
    # tier is listed here: then it runs at container grade on purpose, and its start event
    # says so.
    downgrade_isolation: list[Literal["gvisor", "microvm"]] = []
    address_pool: str = "10.213.0.0/16"  # carved into one /30 per sandbox
    # Unix socket (0600) of `stockade launcher serve` (started by `stockade up`); default
    # <run_dir>/launcher.sock
    control_socket: str = "/run/stockade/launcher.sock"
    # TCP listener ("host:port") of the same API for remote orchestrators; None: the Unix
    # socket only. Every TCP request carries `Authorization: Bearer <token>` (the token
    # in control_token_file); no sandbox can reach it (nft redirects all its TCP)
    control_listen: str | None = Field(None, pattern=r"^[^\s]+:[0-9]{1,5}$")
    # the bearer token of control_listen (one line; mode 0600 or stricter; re-read when
    # it changes, so a rotation needs no restart)
    control_token_file: str | None = None
    # TLS on control_listen: certificate chain and key (PEM); with control_tls_client_ca
    # a client certificate signed by that CA is required too (mTLS)
    control_tls_cert: str | None = None
    control_tls_key: str | None = None
    control_tls_client_ca: str | None = None
    # host directories a TCP caller's inputs and export_dir must resolve beneath (the
    # launcher binds and writes them as root); empty: a TCP caller names no host path
    control_host_paths: list[str] = []
    # per-sandbox root, scratch tmpfs and /etc files live below this
    scratch_dir: str = "/var/lib/stockade/sandboxes"
    nft_table: str = "stockade"  # the one nftables table (family inet) the launcher owns
    nflog_group: int = Field(7413, ge=0, le=65535)  # NFLOG group of the bypass-attempt log records
    default_ttl_s: int = Field(300, ge=1)  # TTL when neither the profile nor --ttl sets one
    # `launcher serve` removes sandboxes whose `stockade run` died this often (seconds)
    reconcile_interval_s: float = Field(10.0, gt=0)
    # `launcher serve` reloads the rules when a file under rules_dir changed (mtime/size, as
    # gateway.rules_poll_interval_s; a kubelet ConfigMap swap too), checked this often
    rules_poll_interval_s: float = Field(2.0, gt=0)
    # names of host-side veths and of netns start with this; reconcile removes what carries it
    name_prefix: str = Field("stk", min_length=1, max_length=5, pattern=r"^[a-z][a-z0-9]*$")
    # cgroup parent (v1: /sys/fs/cgroup/<controller>/<parent>/<id>, v2: <root>/<parent>/<id>)
    cgroup_parent: str = Field("stockade", pattern=r"^[A-Za-z0-9_.-]+$")
    # CPU weight of cgroup_parent, i.e. all sandboxes together, against its siblings such as
    # system.slice (cgroup v2 cpu.weight scale, default there 100; v1: cpu.shares x10.24):
    # when the host is busy the gateway, broker and launcher run first
    cgroup_cpu_weight: int = Field(50, ge=1, le=10000)
    # where the cgroup hierarchies are mounted (v1 or v2 is detected)
    cgroup_root: str = "/sys/fs/cgroup"
    sandbox_uid: int = Field(65534, ge=1)  # the command never runs as root
    sandbox_gid: int = Field(65534, ge=1)  # group of the sandboxed command
    max_output_bytes: int = Field(4 * 2**20, ge=1024)  # per stream; the rest is dropped
    # The sandbox's /etc is its own (generated resolv.conf, hosts, hostname, passwd, group,
    # nsswitch.conf + etc_allowlist): the host's would show its accounts and service configs.
    # Listing "/etc" in ro_binds keeps the old whole-host /etc (etc_allowlist then unused).

    # host dirs bound read-only into the sandbox root; "/etc" here binds the host's whole /etc
    ro_binds: list[str] = ["/usr", "/bin", "/sbin", "/lib", "/lib64"]
    # host /etc entries (relative, globs ok) bound read-only into the sandbox's minimal /etc
    etc_allowlist: list[str] = [
        "alternatives", "ssl/certs", "ssl/openssl.cnf", "ld.so.cache", "ld.so.conf",
        "ld.so.conf.d", "localtime", "timezone", "protocols", "services", "host.conf",
        "gai.conf", "mime.types", "magic", "magic.mime", "python3*", "debian_version",
        "os-release",
    ]
    # host environment variables passed into the sandbox
    env_allowlist: list[str] = ["PATH", "LANG", "LC_ALL", "TERM", "TZ"]
    # failed forks (pids limit hits) after which a sandbox is ended with ended_by=limit
    pids_fail_kill: int = Field(32, ge=1)
    log_rate_per_s: int = Field(20, ge=1)  # nft log limit rate (packets/s, burst 2x)
    # TCP congestion control inside each sandbox (its netns default): all of a sandbox's TCP
    # goes to the gateway and broker on this host, where a pacing algorithm such as bbr only
    # adds timers. reno: the one a network namespace may always choose (others only when
    # net.ipv4.tcp_allowed_congestion_control lists them). None keeps the host's default.
    congestion_control: str | None = Field("reno", pattern=CONGESTION_CONTROL_NAME)
    # rlimits of the command (soft = hard). No RLIMIT_NPROC (it counts per uid across the
    # host; the pids cgroup limits processes), no RLIMIT_FSIZE (the scratch size cap gives
    # a legible ENOSPC instead of SIGXFSZ)
    rlimit_nofile: int = Field(4096, ge=64)
    rlimit_core: int = Field(0, ge=0)  # no core dumps: they would hold the command's memory
    rlimit_memlock: int = Field(64 * 1024, ge=0)  # RLIMIT_MEMLOCK of the command (bytes)
    # Python (3.8+) that runs the sandbox's init and, with libseccomp's binding
    # (python3-seccomp), compiles its seccomp filter; falls back to the launcher's own interpreter
    init_python: str = "/usr/bin/python3"
    shm_size: int = Field(16 * 2**20, ge=4096)  # /dev/shm tmpfs (charged to the memory cgroup)

    @model_validator(mode="after")
    def _control_tcp(self) -> "LauncherSettings":
        if self.control_listen and not self.control_token_file:
            raise ValueError("launcher.control_listen needs launcher.control_token_file")
        if bool(self.control_tls_cert) != bool(self.control_tls_key):
            raise ValueError("launcher.control_tls_cert and control_tls_key go together")
        if self.control_tls_client_ca and not self.control_tls_cert:
            raise ValueError("launcher.control_tls_client_ca needs control_tls_cert")
        return self

    @field_validator("etc_allowlist")
    @classmethod
    def _etc_entries(cls, v: list[str]) -> list[str]:
        return [check_etc_entry(e) for e in v]
