"""L7 inspection: the mitmproxy child (`child.py`, `addon.py`, `patches.py`), the
gateway's side of it (`supervisor.py`) and the pure pieces both share (`handoff.py`,
`requests.py`).

The names below are re-exported lazily (PEP 562): importing the package loads none of
its modules, so nothing imports mitmproxy before the inspector runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .addon import RulesByVersion, inner_request
    from .child import main, run_inspector
    from .supervisor import InspectorSupervisor, InspectorUnavailable, next_delay

_EXPORTS = {
    "main": "child",
    "run_inspector": "child",
    "RulesByVersion": "addon",
    "inner_request": "addon",
    "InspectorSupervisor": "supervisor",
    "InspectorUnavailable": "supervisor",
    "next_delay": "supervisor",
}

__all__ = [
    "InspectorSupervisor",
    "InspectorUnavailable",
    "RulesByVersion",
    "inner_request",
    "main",
    "next_delay",
    "run_inspector",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
