"""The YAML file formats as strict pydantic models (unknown keys and wrong types are errors).

These models only check shape and single values; cross-file checks (presets, API names,
duplicate ids) live in `loader.py`, which turns the result into `model.py` values.
"""

from __future__ import annotations

import ipaddress
from datetime import date
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from .globs import compile_glob
from .hosts import normalize_pattern
from .model import RELAXABLE_SYSCALLS
from .reasons import Reason
from .units import parse_duration, parse_rate, parse_size

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/*@-]{0,199}$"
HTTP_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"}
)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _glob(v: str) -> str:
    compile_glob(v)
    return v


def _method(v: str) -> str:
    up = v.upper()
    if up not in HTTP_METHODS:
        raise ValueError(f"unknown HTTP method {v!r}")
    return up


def _op_method(v: str) -> str:
    return "*" if v == "*" else _method(v)


def _cidr(v: str) -> str:
    try:
        net = ipaddress.ip_network(v, strict=True)
    except ValueError as e:
        raise ValueError(f"invalid CIDR {v!r}: {e}") from None
    return str(net)


def _reason_text(v: str) -> str:
    if not v.strip():
        raise ValueError("reason must say why the entry is needed")
    return v.strip()


def _owner(v: str) -> str:
    if not v.strip():
        raise ValueError("owner must name the person or team who answers for the entry")
    return v.strip()


def _syscall(v: str) -> str:
    if v not in RELAXABLE_SYSCALLS:
        raise ValueError(f"system call {v!r} cannot be allowed: the sandbox's seccomp filter "
                         f"relaxes only {', '.join(RELAXABLE_SYSCALLS)} (new namespaces, "
                         "mounts, bpf, keyrings, io_uring and module loading stay denied)")
    return v


# sizes and durations: text with a unit ("512MiB", "10m") or a bare number; rates: text
# ("5/s"). The JSON Schema (`stockade rules schema`) describes what is written, not the value
Size = Annotated[int, BeforeValidator(parse_size, json_schema_input_type=int | str)]
Duration = Annotated[int, BeforeValidator(parse_duration, json_schema_input_type=int | str)]
Rate = Annotated[float, BeforeValidator(parse_rate, json_schema_input_type=str)]
Name = Annotated[StrictStr, Field(pattern=NAME_PATTERN)]
Port = Annotated[StrictInt, Field(ge=1, le=65535)]
Glob = Annotated[StrictStr, AfterValidator(_glob)]
Method = Annotated[StrictStr, AfterValidator(_method)]
HostPattern = Annotated[StrictStr, AfterValidator(normalize_pattern)]
Cidr = Annotated[StrictStr, AfterValidator(_cidr)]
ReasonText = Annotated[StrictStr, AfterValidator(_reason_text)]
Syscall = Annotated[StrictStr, AfterValidator(_syscall)]
Owner = Annotated[StrictStr, AfterValidator(_owner)]


class HttpModel(Strict):
    methods: list[Method] = []
    paths: list[Glob] = []


class EntryModel(Strict):
    host: HostPattern | None = None
    cidr: Cidr | None = None
    ports: Annotated[list[Port], Field(min_length=1)] | None = None
    # the fields' order is `stockade rules fmt`'s canonical order of an entry's keys
    id: Annotated[StrictStr, Field(pattern=ID_PATTERN)] | None = None
    reason: ReasonText
    expires: Annotated[date, Field(strict=False)] | None = None
    # the periodic review: when the entry is next looked at, and who answers for it
    # (`stockade rules usage` prints both; lint warns once review_by has passed)
    review_by: Annotated[date, Field(strict=False)] | None = None
    owner: Owner | None = None
    http: HttpModel | None = None
    # TLS flows go through the inspector only to hold Host / :authority to the SNI on
    # every request (shared front-ends route by Host: domain fronting); any method/path
    host_must_match_sni: StrictBool = False
    # the explicit opt-out for an uninspected entry on a shared front-end: why fronting
    # through it is acceptable (`stockade rules lint` shows it)
    accept_fronting: ReasonText | None = None

    @model_validator(mode="after")
    def _one_destination(self) -> EntryModel:
        if (self.host is None) == (self.cidr is None):
            raise ValueError("an entry needs exactly one of 'host' or 'cidr'")
        if self.cidr is not None and self.http is not None:
            raise ValueError("'http' needs a 'host' entry (L7 rules match names)")
        if self.cidr is not None and self.host_must_match_sni:
            raise ValueError("'host_must_match_sni' needs a 'host' entry (a cidr entry "
                             "carries raw TCP, with no name to compare)")
        if self.accept_fronting is not None and (self.host_must_match_sni or self.http):
            raise ValueError("'accept_fronting' is for uninspected entries; this one is "
                             "inspected ('http' / 'host_must_match_sni'), so Host is "
                             "already held to the SNI")
        return self


class DenyEntryModel(EntryModel):
    @model_validator(mode="after")
    def _no_http(self) -> DenyEntryModel:
        if self.http is not None:
            raise ValueError("deny entries take no 'http' block; deny the host, or narrow "
                             "the allow entry's http methods/paths")
        if self.host_must_match_sni or self.accept_fronting is not None:
            raise ValueError("deny entries take no 'host_must_match_sni' / "
                             "'accept_fronting' (nothing they match goes out)")
        return self


class LimitsModel(Strict):
    cpus: Annotated[float, Field(gt=0, le=256, strict=False)] = 1.0
    memory: Size = 512 * 2**20
    disk: Size = 1 * 2**30
    pids: Annotated[StrictInt, Field(ge=1)] = 256
    ttl: Duration = 300
    egress_bytes: Size = 1 * 2**30


class EgressModel(Strict):
    mode: Literal["enforce", "report"] = "enforce"
    # the launcher sets HTTP(S)_PROXY to the gateway's explicit proxy listener (for tools
    # that only work with an explicit proxy); traffic is transparent either way
    proxy_env: StrictBool = False
    presets: list[Name] = []
    allow: list[EntryModel] = []
    deny: list[DenyEntryModel] = []


class OperationModel(Strict):
    method: Annotated[StrictStr, AfterValidator(_op_method)]
    path: Glob


class BudgetModel(Strict):
    calls: Annotated[StrictInt, Field(ge=0)] | None = None
    bytes: Size | None = None


class GrantModel(Strict):
    operations: Annotated[list[OperationModel], Field(min_length=1)]
    rate: Rate = 10.0
    burst: Annotated[StrictInt, Field(ge=1)] = 20
    budget: BudgetModel = BudgetModel()
    max_body: Size = 1 * 2**20


class BrokerModel(Strict):
    apis: dict[Name, GrantModel] = {}


class ExportsModel(Strict):
    max_file: Size = 10 * 2**20
    max_total: Size = 50 * 2**20
    types: list[Literal["text", "json", "binary", "archive", "image"]] = ["text", "json"]


class SyscallsModel(Strict):
    allow: Annotated[list[Syscall], Field(min_length=1)]
    reason: ReasonText

    @model_validator(mode="after")
    def _no_repeats(self) -> SyscallsModel:
        twice = sorted({n for n in self.allow if self.allow.count(n) > 1})
        if twice:
            raise ValueError(f"system call(s) listed twice: {', '.join(twice)}")
        return self


class SandboxModel(Strict):
    syscalls: SyscallsModel | None = None


class ProfileModel(Strict):
    profile: Name
    description: StrictStr = ""
    isolation: Literal["container", "gvisor", "microvm"] = "container"
    limits: LimitsModel = LimitsModel()
    egress: EgressModel = EgressModel()
    broker: BrokerModel = BrokerModel()
    exports: ExportsModel = ExportsModel()
    sandbox: SandboxModel = SandboxModel()
    # required: every start proves the fence first; sampled: launcher.selftest.sample_rate
    selftest: Literal["required", "sampled"] = "required"


class PresetModel(Strict):
    preset: Name
    description: StrictStr = ""
    allow: list[EntryModel] = []
    deny: list[DenyEntryModel] = []


class CredentialModel(Strict):
    mount: Annotated[StrictStr, Field(min_length=1)]
    path: Annotated[StrictStr, Field(min_length=1)]
    field: Annotated[StrictStr, Field(min_length=1)]


class InjectModel(Strict):
    style: Literal["bearer", "header", "basic", "query"]
    header: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9-]{1,64}$")] | None = None
    template: StrictStr | None = None
    username: StrictStr | None = None
    param: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None

    @model_validator(mode="after")
    def _fields_for_style(self) -> InjectModel:
        need = {"header": "header", "basic": "username", "query": "param"}.get(self.style)
        if need and getattr(self, need) is None:
            raise ValueError(f"style {self.style!r} needs '{need}'")
        allowed = {"bearer": set(), "header": {"header", "template"}, "basic": {"username"},
                   "query": {"param"}}[self.style]  # fmt: skip
        extra = {k for k in ("header", "template", "username", "param")
                 if getattr(self, k) is not None} - allowed  # fmt: skip
        if extra:
            raise ValueError(f"style {self.style!r} takes no {', '.join(sorted(extra))}")
        if self.template is not None and "{secret}" not in self.template:
            raise ValueError("template must contain '{secret}'")
        return self


class ApiModel(Strict):
    api: Name
    description: StrictStr = ""
    base_url: StrictStr
    allow_plain_http: StrictBool = False
    credential: CredentialModel
    inject: InjectModel

    @model_validator(mode="after")
    def _url(self) -> ApiModel:
        u = urlsplit(self.base_url)
        if u.scheme not in ("https", "http") or not u.hostname:
            raise ValueError("base_url must be an absolute https:// URL")
        if u.scheme == "http" and not self.allow_plain_http:
            raise ValueError("base_url is plain http; set allow_plain_http: true if intended")
        if u.username or u.password or u.query or u.fragment:
            raise ValueError("base_url must not carry userinfo, query or fragment")
        return self


def _source_url(v: str) -> str:
    u = urlsplit(v)
    if u.scheme != "https" or not u.hostname:
        raise ValueError("source must be the https:// URL of the provider's published list "
                         "or documentation")
    return v


SourceUrl = Annotated[StrictStr, AfterValidator(_source_url)]


class FrontendGroupModel(Strict):
    """Names or address ranges of one provider's shared front-ends, from one source."""

    provider: Name
    source: SourceUrl
    checked: Annotated[date, Field(strict=False)]  # when the source was last compared
    note: StrictStr = ""
    hosts: list[HostPattern] = []
    cidrs: list[Cidr] = []

    @model_validator(mode="after")
    def _something(self) -> FrontendGroupModel:
        if not self.hosts and not self.cidrs:
            raise ValueError("a front-end group needs 'hosts' or 'cidrs'")
        return self


class CatalogueModel(Strict):
    catalogue: Name
    description: StrictStr = ""
    frontends: Annotated[list[FrontendGroupModel], Field(min_length=1)]


UPLOAD_KINDS = ("object-store", "gist", "paste", "file-transfer", "webhook", "raw-content",
                "code-host", "package-registry")


class UploadServiceModel(Strict):
    """One provider's names that accept uploads from anyone, from one source."""

    provider: Annotated[StrictStr, Field(pattern=NAME_PATTERN)]
    kind: Literal[UPLOAD_KINDS]  # type: ignore[valid-type]
    source: SourceUrl
    checked: Annotated[date, Field(strict=False)]  # when the group was compiled / compared
    note: StrictStr = ""
    hosts: Annotated[list[HostPattern], Field(min_length=1)]


class UploadCatalogueModel(Strict):
    """policy/upload_services.yaml: the catalogue lint's upload warnings read."""

    catalogue: Name
    description: StrictStr = ""
    services: Annotated[list[UploadServiceModel], Field(min_length=1)]


class TestCaseModel(Strict):
    profile: Name
    target: Annotated[StrictStr, Field(min_length=1)]
    method: Method | None = None
    expect: Literal["allow", "deny"]
    rule: StrictStr | None = None
    reason: Reason | None = Field(default=None, strict=False)


class TestFileModel(Strict):
    tests: list[TestCaseModel]
