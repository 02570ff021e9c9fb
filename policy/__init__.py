"""The rule model: YAML schema, loader, validation, matching, decision. Pure code."""

from .decide import decide, decide_name, match_operation
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
