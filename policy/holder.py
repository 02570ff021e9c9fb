"""The rules holder: one RuleSet in force, swapped atomically on reload.

The gateway and the launcher each keep one (hence here, in the rule model, not in either).

Reload triggers: SIGHUP, the control API, and a change of any file under the rules
directory (polled by mtime/size; no inotify dependency). An invalid rule set is
refused with an error event and the old one stays in force (fail closed, never open).
Live connections keep the decision they were given; a reload never drops them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from stockade.events import make_event
from stockade.events.build import Decision

from .ruleset import RuleSet


class _Counter(Protocol):
    def inc(self) -> None: ...


class _Labelled(Protocol):
    def labels(self, outcome: str) -> _Counter: ...


class ReloadMetrics(Protocol):
    """What the holder counts in (the gateway's GatewayMetrics): reloads by outcome."""

    reloads: _Labelled


Snapshot = tuple[tuple[str, int, int], ...]


def snapshot(root: Path) -> Snapshot:
    """(path, mtime_ns, size) of every file under `root`, sorted: equal means unchanged."""
    out: list[tuple[str, int, int]] = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out.append((p, st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


class RulesHolder:
    def __init__(
        self,
        rules_dir: str | os.PathLike[str],
        emit: Callable[[dict[str, Any]], None],
        metrics: ReloadMetrics | None = None,
        component: str = "gateway",
    ) -> None:
        self.rules_dir = Path(rules_dir)
        self.emit = emit
        self.metrics = metrics
        self.component = component
        self._current: RuleSet | None = None
        self._snapshot: Snapshot = ()

    @property
    def current(self) -> RuleSet:
        if self._current is None:
            raise RuntimeError("rules not loaded")
        return self._current

    def __call__(self) -> RuleSet:
        """The rule set in force (the `rules` callable the DNS firewall takes)."""
        return self.current

    def load_initial(self) -> RuleSet:
        """First load; raises stockade.policy.RulesError (the gateway refuses to start)."""
        from stockade.policy import load_rules

        snap = snapshot(self.rules_dir)
        self._current = load_rules(self.rules_dir)
        self._snapshot = snap
        return self._current

    def changed(self) -> bool:
        return snapshot(self.rules_dir) != self._snapshot

    def poll(self, trigger: str = "file_change") -> dict[str, Any] | None:
        """Reload when a file changed since the last load (the reload's summary), else None:
        the file watch of a component that polls from a worker thread (the launcher)."""
        return self.reload(trigger) if self.changed() else None

    def reload(self, trigger: str) -> dict[str, Any]:
        """Load and swap; on any problem keep the old rules. Returns a JSON-able summary."""
        from stockade.policy import RulesError, load_rules

        snap = snapshot(self.rules_dir)
        old = self._current.version if self._current else None
        try:
            new = load_rules(self.rules_dir)
        except RulesError as e:
            self._snapshot = snap  # do not retry the same broken files every poll
            problems = [str(p) for p in getattr(e, "problems", [])][:20]
            if self.metrics:
                self.metrics.reloads.labels("failure").inc()
            self._event(
                "denied",
                "rules_invalid",
                old,
                f"rule reload ({trigger}) refused; previous rules stay in force",
                {"problems": problems, "trigger": trigger},
            )
            return {"ok": False, "version": old, "problems": problems}
        self._current = new  # a single reference swap: readers see old or new, never a mix
        self._snapshot = snap
        if self.metrics:
            self.metrics.reloads.labels("success").inc()
        self._event(
            "allowed",
            "rules_loaded",
            new.version,
            f"rules reloaded ({trigger}): {old} -> {new.version}",
            {"trigger": trigger, "previous_version": old},
        )
        return {"ok": True, "version": new.version, "previous": old}

    def _event(
        self,
        decision: Decision,
        reason: str,
        version: str | None,
        message: str,
        extra: dict[str, Any],
    ) -> None:
        """One rules_reload event (refused or done) on the holder's stream."""
        self.emit(
            make_event(
                component="rules",
                action="rules_reload",
                decision=decision,
                reason=reason,
                policy_version=version,
                message=message,
                extra=extra,
            )
        )
