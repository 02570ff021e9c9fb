"""Compatibility shim: the rules holder lives in `stockade.policy.holder` (issue #14)."""

from stockade.policy.holder import RulesHolder, Snapshot, snapshot

__all__ = ["RulesHolder", "Snapshot", "snapshot"]
