"""The rule model: YAML schema, loader, validation, matching, decision. Pure code.

The names are imported on first use (stockade/lazy.py): the CLI's parser imports
`stockade.policy.cli`, which must not load the rule loader and matcher first."""

from typing import TYPE_CHECKING

from stockade.lazy import exports_of, lazy_exports

# imported now, not on first use: `decide` is also its submodule's name, and importing
# the submodule later (`from stockade.policy.decide import ...`) would bind the package's
# `decide` to the module, shadowing the function for `from stockade.policy import decide`
from .decide import decide, decide_name, match_operation

if TYPE_CHECKING:
    from .hosts import HostError, normalize_host, normalize_pattern, split_host_port
    from .loader import load_rules
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
        RequestFacts,
        SharedFrontend,
        SourceLocation,
        Verdict,
    )
    from .problems import Problem, RulesError
    from .reasons import Reason
    from .ruleset import RuleSet

__all__ = [
    "ApiDefinition",
    "BrokerGrant",
    "BrokerOperation",
    "CredentialSource",
    "EgressEntry",
    "ExportPolicy",
    "HostError",
    "HttpRule",
    "Injection",
    "Limits",
    "PolicyTestCase",
    "Preset",
    "Problem",
    "Profile",
    "Reason",
    "RequestFacts",
    "RuleSet",
    "RulesError",
    "SharedFrontend",
    "SourceLocation",
    "Verdict",
    "decide",
    "decide_name",
    "load_rules",
    "match_operation",
    "normalize_host",
    "normalize_pattern",
    "split_host_port",
]
__getattr__ = lazy_exports(__name__, exports_of({
    ".hosts": ("HostError", "normalize_host", "normalize_pattern", "split_host_port"),
    ".loader": ("load_rules",),
    ".model": ("ApiDefinition", "BrokerGrant", "BrokerOperation", "CredentialSource",
               "EgressEntry", "ExportPolicy", "HttpRule", "Injection", "Limits",
               "PolicyTestCase", "Preset", "Profile", "RequestFacts", "SharedFrontend",
               "SourceLocation", "Verdict"),
    ".problems": ("Problem", "RulesError"),
    ".reasons": ("Reason",),
    ".ruleset": ("RuleSet",),
}))
