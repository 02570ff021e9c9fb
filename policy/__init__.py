"""The rule model: YAML schema, loader, validation, matching, decision. Pure code."""

from .model import (
    ApiDefinition,
    BrokerGrant,
    BrokerOperation,
    EgressEntry,
    Profile,
    RequestFacts,
    Verdict,
)
from .reasons import Reason

__all__ = [
    "ApiDefinition",
    "BrokerGrant",
    "BrokerOperation",
    "EgressEntry",
    "Profile",
    "Reason",
    "RequestFacts",
    "Verdict",
]
