"""The loaded rule set: what `load_rules` returns and every decision reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from .index import CompiledProfile
from .model import ApiDefinition, PolicyTestCase, Preset, Profile, SharedFrontend


@dataclass(frozen=True, slots=True)
class RuleSet:
    root: str  # the rules directory it was loaded from
    version: str  # sha256 of the canonical content, 16 hex; `rule.ruleset` in events
    profiles: dict[str, Profile]
    apis: dict[str, ApiDefinition]
    presets: dict[str, Preset]
    tests: tuple[PolicyTestCase, ...] = ()
    # the shared front-end catalogue (lint only: no decision reads it, so it is not part
    # of `version`)
    frontends: tuple[SharedFrontend, ...] = ()
    compiled: dict[str, CompiledProfile] = field(default_factory=dict, repr=False)
