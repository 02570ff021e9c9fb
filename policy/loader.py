"""`load_rules(dir)`: read, validate and cross-check every rule file, then compile.

Collects every problem (not just the first) so `stockade rules lint` can list them all;
any error refuses the whole rule set (the gateway keeps its old rules).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .index import CompiledProfile
from .model import (
    ApiDefinition,
    BrokerGrant,
    BrokerOperation,
    CredentialSource,
    EgressEntry,
    ExportPolicy,
    HttpRule,
    Injection,
    Limits,
    PolicyTestCase,
    Preset,
    Profile,
    SharedFrontend,
    SourceLocation,
    SyscallRelaxation,
)
from .problems import Problem, RulesError
from .ruleset import RuleSet
from .schema import (
    ApiModel,
    CatalogueModel,
    DenyEntryModel,
    EntryModel,
    PresetModel,
    ProfileModel,
    TestFileModel,
)
from .yamlsrc import Document, Path_, YamlProblem, dotted, read_yaml

KINDS = ("apis", "presets", "profiles", "tests", "catalogues")
M = TypeVar("M", bound=BaseModel)


class _Source:
    """One rule file: its name for messages, parsed document, and the problem sink."""

    def __init__(self, path: Path, doc: Document, problems: list[Problem]) -> None:
        self.name = str(path)
        self.doc = doc
        self.problems = problems

    def loc(self, path: Path_) -> SourceLocation:
        m = self.doc.mark_for(path)
        return SourceLocation(self.name, m.line, m.column)

    def error(self, path: Path_, message: str, at_key: bool = False) -> None:
        m = self.doc.key_marks.get(path) if at_key else None
        m = m or self.doc.mark_for(path)
        self.problems.append(Problem(self.name, m.line, m.column, f"{dotted(path)}: {message}"))

    def validate(self, model: type[M]) -> M | None:
        if not isinstance(self.doc.data, dict):
            self.error((), "expected a mapping at the top level")
            return None
        try:
            return model.model_validate(self.doc.data)
        except ValidationError as e:
            for err in e.errors():
                path = tuple(p for p in err["loc"] if isinstance(p, int) or "[" not in p)
                self.error(path, _message(err), at_key=err["type"] == "extra_forbidden")
            return None


def _message(err: Any) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _read_sources(root: Path, problems: list[Problem]) -> dict[str, list[_Source]]:
    out: dict[str, list[_Source]] = {k: [] for k in KINDS}
    for kind in KINDS:
        folder = root / kind
        if not folder.is_dir():
            continue
        files = sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml"))
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                problems.append(Problem(str(path), 1, 1, f"cannot read: {e}"))
                continue
            try:
                doc = read_yaml(text, str(path))
            except YamlProblem as e:
                problems.append(Problem(str(path), e.mark.line, e.mark.column, e.message))
                continue
            if doc.data is None:
                problems.append(Problem(str(path), 1, 1, "empty file"))
                continue
            out[kind].append(_Source(path, doc, problems))
    return out


def _entries(
    src: _Source,
    models: list[EntryModel] | list[DenyEntryModel],
    base: Path_,
    kind: str,
    owner: str,
    origin: str,
) -> list[EgressEntry]:
    out = []
    for i, m in enumerate(models):
        dest = m.host if m.host is not None else m.cidr
        assert dest is not None
        if m.ports is not None:
            ports = frozenset(m.ports)
        else:
            ports = frozenset() if kind == "deny" else frozenset({443})
        http = None
        if m.http is not None:
            http = HttpRule(frozenset(m.http.methods), tuple(m.http.paths))
        out.append(
            EgressEntry(
                id=m.id or f"{owner}:{kind}:{dest}",
                reason=m.reason,
                host=m.host,
                cidr=ipaddress.ip_network(m.cidr) if m.cidr is not None else None,
                ports=ports,
                expires=m.expires,
                http=http,
                host_must_match_sni=m.host_must_match_sni,
                accept_fronting=m.accept_fronting,
                origin=origin,
                location=src.loc((*base, kind, i)),
            )
        )
    return out


def _catalogues(sources: list[_Source]) -> tuple[SharedFrontend, ...]:
    """Every host pattern and range of the shared front-end catalogues, with its source."""
    out: list[SharedFrontend] = []
    names: dict[str, str] = {}
    for src in sources:
        cm = src.validate(CatalogueModel)
        if cm is None:
            continue
        if cm.catalogue in names:
            src.error(("catalogue",), f"duplicate catalogue name (first in {names[cm.catalogue]})")
            continue
        names[cm.catalogue] = src.name
        for i, g in enumerate(cm.frontends):
            base = ("frontends", i)
            out.extend(
                SharedFrontend(g.provider, g.source, g.checked, host=h,
                               location=src.loc((*base, "hosts", j)))
                for j, h in enumerate(g.hosts)
            )  # fmt: skip
            out.extend(
                SharedFrontend(g.provider, g.source, g.checked, cidr=ipaddress.ip_network(c),
                               location=src.loc((*base, "cidrs", j)))
                for j, c in enumerate(g.cidrs)
            )  # fmt: skip
    return tuple(out)


def _canonical(data: Any) -> Any:
    return json.loads(json.dumps(data, sort_keys=True, default=str))


def load_rules(rules_dir: str | Path) -> RuleSet:
    """Load and validate `rules_dir`; raises RulesError listing every problem."""
    root = Path(rules_dir)
    problems: list[Problem] = []
    if not root.is_dir():
        raise RulesError([Problem(str(root), 1, 1, "rules directory not found")])
    sources = _read_sources(root, problems)
    ids: dict[str, SourceLocation] = {}
    canonical: dict[str, dict[str, Any]] = {"apis": {}, "presets": {}, "profiles": {}}

    def claim_ids(src: _Source, entries: list[EgressEntry]) -> None:
        for e in entries:
            if e.id in ids:
                first = ids[e.id]
                assert e.location is not None
                problems.append(
                    Problem(src.name, e.location.line, e.location.column,
                            f"id: duplicate rule id {e.id!r} (first at {first}); "
                            "give one of the entries an explicit, distinct 'id'")
                )
            else:
                assert e.location is not None
                ids[e.id] = e.location

    apis: dict[str, ApiDefinition] = {}
    for src in sources["apis"]:
        am = src.validate(ApiModel)
        if am is None:
            continue
        if am.api in apis:
            src.error(("api",), f"duplicate API name (first at {apis[am.api].location})")
            continue
        inj = am.inject
        apis[am.api] = ApiDefinition(
            name=am.api,
            base_url=am.base_url,
            credential=CredentialSource(am.credential.mount, am.credential.path,
                                        am.credential.field),
            injection=Injection(inj.style, header=inj.header, template=inj.template,
                                query_param=inj.param, username=inj.username),
            allow_plain_http=am.allow_plain_http,
            description=am.description,
            location=src.loc(()),
        )
        canonical["apis"][am.api] = _canonical(src.doc.data)

    presets: dict[str, Preset] = {}
    for src in sources["presets"]:
        pm = src.validate(PresetModel)
        if pm is None:
            continue
        if pm.preset in presets:
            first = presets[pm.preset].location
            src.error(("preset",), f"duplicate preset name (first at {first})")
            continue
        origin = f"preset:{pm.preset}"
        allow = _entries(src, pm.allow, (), "allow", pm.preset, origin)
        deny = _entries(src, pm.deny, (), "deny", pm.preset, origin)
        claim_ids(src, allow + deny)
        presets[pm.preset] = Preset(pm.preset, pm.description, tuple(allow), tuple(deny),
                                    src.loc(()))  # fmt: skip
        canonical["presets"][pm.preset] = _canonical(src.doc.data)

    profiles: dict[str, Profile] = {}
    for src in sources["profiles"]:
        prm = src.validate(ProfileModel)
        if prm is None:
            continue
        if prm.profile in profiles:
            src.error(("profile",), f"duplicate profile name (first at "
                      f"{profiles[prm.profile].location})")  # fmt: skip
            continue
        name = prm.profile
        origin = f"profile:{name}"
        allow = _entries(src, prm.egress.allow, ("egress",), "allow", name, origin)
        deny = _entries(src, prm.egress.deny, ("egress",), "deny", name, origin)
        claim_ids(src, allow + deny)
        seen: set[str] = set()
        for i, pname in enumerate(prm.egress.presets):
            if pname in seen:
                src.error(("egress", "presets", i), f"preset {pname!r} listed twice")
                continue
            seen.add(pname)
            preset = presets.get(pname)
            if preset is None:
                known = ", ".join(sorted(presets)) or "none"
                src.error(("egress", "presets", i), f"unknown preset {pname!r} (known: {known})")
                continue
            allow.extend(preset.allow)
            deny.extend(preset.deny)
        grants: dict[str, BrokerGrant] = {}
        for api, g in prm.broker.apis.items():
            if api not in apis:
                known = ", ".join(sorted(apis)) or "none"
                src.error(("broker", "apis", api), f"unknown API {api!r} (known: {known})")
                continue
            grants[api] = BrokerGrant(
                api=api,
                operations=tuple(BrokerOperation(o.method, o.path) for o in g.operations),
                rate_per_second=g.rate,
                burst=g.burst,
                budget_calls=g.budget.calls,
                budget_bytes=g.budget.bytes,
                max_body_bytes=g.max_body,
            )
        lim = prm.limits
        sc = prm.sandbox.syscalls
        profiles[name] = Profile(
            name=name,
            description=prm.description,
            isolation=prm.isolation,
            limits=Limits(cpus=lim.cpus, memory=lim.memory, disk=lim.disk, pids=lim.pids,
                          ttl=lim.ttl, egress_bytes=lim.egress_bytes),
            mode=prm.egress.mode,
            proxy_env=prm.egress.proxy_env,
            allow=tuple(allow),
            deny=tuple(deny),
            presets=tuple(prm.egress.presets),
            broker=grants,
            exports=ExportPolicy(prm.exports.max_file, prm.exports.max_total,
                                 tuple(prm.exports.types)),
            syscalls=None if sc is None else SyscallRelaxation(
                frozenset(sc.allow), sc.reason, src.loc(("sandbox", "syscalls"))),
            location=src.loc(()),
        )
        # the whole document, so every setting is in the version (`egress.proxy_env: true`
        # changes the sandbox's environment and firewall: a rule change like any other)
        canonical["profiles"][name] = _canonical(src.doc.data)

    tests: list[PolicyTestCase] = []
    for src in sources["tests"]:
        tm = src.validate(TestFileModel)
        if tm is None:
            continue
        for i, t in enumerate(tm.tests):
            if t.profile not in profiles:
                src.error(("tests", i, "profile"), f"unknown profile {t.profile!r}")
                continue
            if t.rule is not None and t.rule not in ids:
                src.error(("tests", i, "rule"), f"unknown rule id {t.rule!r}")
                continue
            tests.append(
                PolicyTestCase(
                    profile=t.profile,
                    target=t.target,
                    method=t.method,
                    expect=t.expect,
                    rule=t.rule,
                    reason=str(t.reason) if t.reason is not None else None,
                    location=src.loc(("tests", i)),
                )
            )

    frontends = _catalogues(sources["catalogues"])
    if any(p.severity == "error" for p in problems):
        raise RulesError(problems)
    blob = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    version = hashlib.sha256(blob).hexdigest()[:16]
    return RuleSet(
        root=str(root),
        version=version,
        profiles=profiles,
        apis=apis,
        presets=presets,
        tests=tuple(tests),
        frontends=frontends,
        compiled={n: CompiledProfile.build(p, version) for n, p in profiles.items()},
    )
