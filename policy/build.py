"""Validated schema models of one rule file -> the rule model's objects.

Each builder takes the file (`Source`, for locations and problems) and its pydantic model
and returns frozen rule-model objects; the cross-file checks (names, ids, versions) are the
loader's. The rule model is named qualified (`model.Profile`): these builders make nearly
every one of its types.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from . import model
from .schema import ApiModel, CatalogueModel, DenyEntryModel, EntryModel, ProfileModel
from .sources import Source
from .suggest import did_you_mean
from .yamlsrc import Path_


def entries(
    src: Source,
    models: list[EntryModel] | list[DenyEntryModel],
    base: Path_,
    kind: str,
    owner: str,
    origin: str,
) -> list[model.EgressEntry]:
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
            http = model.HttpRule(frozenset(m.http.methods), tuple(m.http.paths))
        out.append(
            model.EgressEntry(
                id=m.id or f"{owner}:{kind}:{dest}",
                reason=m.reason,
                host=m.host,
                cidr=ipaddress.ip_network(m.cidr) if m.cidr is not None else None,
                ports=ports,
                expires=m.expires,
                review_by=m.review_by,
                owner=m.owner,
                http=http,
                host_must_match_sni=m.host_must_match_sni,
                accept_fronting=m.accept_fronting,
                origin=origin,
                location=src.loc((*base, kind, i)),
            )
        )
    return out


def catalogues(sources: list[Source]) -> tuple[model.SharedFrontend, ...]:
    """Every host pattern and range of the shared front-end catalogues, with its source."""
    out: list[model.SharedFrontend] = []
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
                model.SharedFrontend(g.provider, g.source, g.checked, host=h,
                                     location=src.loc((*base, "hosts", j)))
                for j, h in enumerate(g.hosts)
            )  # fmt: skip
            out.extend(
                model.SharedFrontend(g.provider, g.source, g.checked,
                                     cidr=ipaddress.ip_network(c),
                                     location=src.loc((*base, "cidrs", j)))
                for j, c in enumerate(g.cidrs)
            )  # fmt: skip
    return tuple(out)


def api_definition(src: Source, am: ApiModel) -> model.ApiDefinition:
    inj = am.inject
    return model.ApiDefinition(
        name=am.api,
        base_url=am.base_url,
        credential=model.CredentialSource(am.credential.mount, am.credential.path,
                                          am.credential.field),
        injection=model.Injection(inj.style, header=inj.header, template=inj.template,
                                  query_param=inj.param, username=inj.username),
        allow_plain_http=am.allow_plain_http,
        description=am.description,
        location=src.loc(()),
    )


def add_presets(
    src: Source,
    names: Sequence[str],
    presets: Mapping[str, model.Preset],
    allow: list[model.EgressEntry],
    deny: list[model.EgressEntry],
) -> None:
    """Append the entries of the presets a profile lists (each once, each known)."""
    seen: set[str] = set()
    for i, pname in enumerate(names):
        if pname in seen:
            src.error(("egress", "presets", i), f"preset {pname!r} listed twice")
            continue
        seen.add(pname)
        preset = presets.get(pname)
        if preset is None:
            known = ", ".join(sorted(presets)) or "none"
            src.error(("egress", "presets", i),
                      f"unknown preset {pname!r}{did_you_mean(pname, presets)} (known: {known})")
            continue
        allow.extend(preset.allow)
        deny.extend(preset.deny)


def grants(
    src: Source, prm: ProfileModel, apis: Mapping[str, model.ApiDefinition]
) -> dict[str, model.BrokerGrant]:
    """The profile's broker grants, each naming a known API."""
    out: dict[str, model.BrokerGrant] = {}
    for api, g in prm.broker.apis.items():
        if api not in apis:
            known = ", ".join(sorted(apis)) or "none"
            src.error(("broker", "apis", api),
                      f"unknown API {api!r}{did_you_mean(api, apis)} (known: {known})")
            continue
        out[api] = model.BrokerGrant(
            api=api,
            operations=tuple(model.BrokerOperation(o.method, o.path) for o in g.operations),
            rate_per_second=g.rate,
            burst=g.burst,
            budget_calls=g.budget.calls,
            budget_bytes=g.budget.bytes,
            max_body_bytes=g.max_body,
        )
    return out


def profile(
    src: Source,
    prm: ProfileModel,
    allow: list[model.EgressEntry],
    deny: list[model.EgressEntry],
    broker: dict[str, model.BrokerGrant],
) -> model.Profile:
    lim = prm.limits
    sc = prm.sandbox.syscalls
    return model.Profile(
        name=prm.profile,
        description=prm.description,
        isolation=prm.isolation,
        limits=model.Limits(cpus=lim.cpus, memory=lim.memory, disk=lim.disk, pids=lim.pids,
                            ttl=lim.ttl, egress_bytes=lim.egress_bytes),
        mode=prm.egress.mode,
        proxy_env=prm.egress.proxy_env,
        selftest=prm.selftest,
        allow=tuple(allow),
        deny=tuple(deny),
        presets=tuple(prm.egress.presets),
        broker=broker,
        exports=model.ExportPolicy(prm.exports.max_file, prm.exports.max_total,
                                   tuple(prm.exports.types)),
        syscalls=None if sc is None else model.SyscallRelaxation(
            frozenset(sc.allow), sc.reason, src.loc(("sandbox", "syscalls"))),
        location=src.loc(()),
    )
