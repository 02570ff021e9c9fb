"""`load_rules(dir)`: read, validate and cross-check every rule file, then compile.

Collects every problem (not just the first) so `stockade rules lint` can list them all;
any error refuses the whole rule set (the gateway keeps its old rules). Reading is
`sources.py`, building one file's objects `build.py`; this module checks across files
(unique names and rule ids, known presets, APIs and profiles) and versions the set.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from . import build
from .index import CompiledProfile
from .model import ApiDefinition, EgressEntry, PolicyTestCase, Preset, Profile, SourceLocation
from .problems import Problem, RulesError
from .ruleset import RuleSet
from .schema import ApiModel, PresetModel, ProfileModel, TestFileModel
from .sources import M, Source, read_sources
from .suggest import did_you_mean


def _canonical(data: Any) -> Any:
    return json.loads(json.dumps(data, sort_keys=True, default=str))


class _Book:
    """What the loader gathers across files: the rule ids (unique in the whole set) and
    the canonical documents the version is the hash of."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        self.ids: dict[str, SourceLocation] = {}
        self.canonical: dict[str, dict[str, Any]] = {"apis": {}, "presets": {}, "profiles": {}}

    def claim_ids(self, src: Source, entries: list[EgressEntry]) -> None:
        for e in entries:
            assert e.location is not None
            if e.id in self.ids:
                first = self.ids[e.id]
                self.problems.append(
                    Problem(src.name, e.location.line, e.location.column,
                            f"id: duplicate rule id {e.id!r} (first at {first}); "
                            "give one of the entries an explicit, distinct 'id'")
                )  # fmt: skip
            else:
                self.ids[e.id] = e.location

    def keep(self, kind: str, name: str, src: Source) -> None:
        # the whole document, so every setting is in the version (`egress.proxy_env: true`
        # changes the sandbox's environment and firewall: a rule change like any other)
        self.canonical[kind][name] = _canonical(src.doc.data)

    def version(self) -> str:
        blob = json.dumps(self.canonical, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _named(
    sources: list[Source], schema: type[M], key: str, label: str, known: Mapping[str, Any]
) -> Iterator[tuple[Source, M]]:
    """Each valid document whose name (its `key`) is not in `known` yet; the caller adds
    every one it is handed, so a later file of the same name is reported as a duplicate."""
    for src in sources:
        doc = src.validate(schema)
        if doc is None:
            continue
        name = getattr(doc, key)
        if name in known:
            src.error((key,), f"duplicate {label} name (first at {known[name].location})")
            continue
        yield src, doc


def _apis(sources: list[Source], book: _Book) -> dict[str, ApiDefinition]:
    apis: dict[str, ApiDefinition] = {}
    for src, am in _named(sources, ApiModel, "api", "API", apis):
        apis[am.api] = build.api_definition(src, am)
        book.keep("apis", am.api, src)
    return apis


def _presets(sources: list[Source], book: _Book) -> dict[str, Preset]:
    presets: dict[str, Preset] = {}
    for src, pm in _named(sources, PresetModel, "preset", "preset", presets):
        origin = f"preset:{pm.preset}"
        allow = build.entries(src, pm.allow, (), "allow", pm.preset, origin)
        deny = build.entries(src, pm.deny, (), "deny", pm.preset, origin)
        book.claim_ids(src, allow + deny)
        presets[pm.preset] = Preset(pm.preset, pm.description, tuple(allow), tuple(deny),
                                    src.loc(()))  # fmt: skip
        book.keep("presets", pm.preset, src)
    return presets


def _profiles(
    sources: list[Source],
    presets: Mapping[str, Preset],
    apis: Mapping[str, ApiDefinition],
    book: _Book,
) -> dict[str, Profile]:
    profiles: dict[str, Profile] = {}
    for src, prm in _named(sources, ProfileModel, "profile", "profile", profiles):
        name = prm.profile
        origin = f"profile:{name}"
        allow = build.entries(src, prm.egress.allow, ("egress",), "allow", name, origin)
        deny = build.entries(src, prm.egress.deny, ("egress",), "deny", name, origin)
        book.claim_ids(src, allow + deny)  # before the presets': those were claimed there
        build.add_presets(src, prm.egress.presets, presets, allow, deny)
        grants = build.grants(src, prm, apis)
        profiles[name] = build.profile(src, prm, allow, deny, grants)
        book.keep("profiles", name, src)
    return profiles


def _tests(
    sources: list[Source], profiles: Mapping[str, Profile], ids: Mapping[str, SourceLocation]
) -> list[PolicyTestCase]:
    tests: list[PolicyTestCase] = []
    for src in sources:
        tm = src.validate(TestFileModel)
        if tm is None:
            continue
        for i, t in enumerate(tm.tests):
            if t.profile not in profiles:
                src.error(("tests", i, "profile"),
                          f"unknown profile {t.profile!r}{did_you_mean(t.profile, profiles)}")
                continue
            if t.rule is not None and t.rule not in ids:
                src.error(("tests", i, "rule"),
                          f"unknown rule id {t.rule!r}{did_you_mean(t.rule, ids)}")
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
    return tests


def load_rules(rules_dir: str | Path) -> RuleSet:
    """Load and validate `rules_dir`; raises RulesError listing every problem."""
    root = Path(rules_dir)
    problems: list[Problem] = []
    if not root.is_dir():
        raise RulesError([Problem(str(root), 1, 1, "rules directory not found")])
    sources = read_sources(root, problems)
    book = _Book(problems)
    # in this order: presets before the profiles that list them, profiles and every
    # rule id before the tests that name them (and the problems in file order per kind)
    apis = _apis(sources["apis"], book)
    presets = _presets(sources["presets"], book)
    profiles = _profiles(sources["profiles"], presets, apis, book)
    tests = _tests(sources["tests"], profiles, book.ids)
    frontends = build.catalogues(sources["catalogues"])
    if any(p.severity == "error" for p in problems):
        raise RulesError(problems)
    version = book.version()
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
