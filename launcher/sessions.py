"""The session table of the control service (pure: no clock, no I/O; `now` is passed).

A session is a sandbox started with no command (`SandboxSpec.session`) whose sandbox
deadline is its profile's `limits.ttl` (the hard cap); its own expiry starts at the TTL
asked for and can be moved, never past that cap. The service kills what `expired` names.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

ENDED_KEPT = 256  # ended sessions still answered by GET (oldest dropped first)


@dataclass
class SessionRow:
    session_id: str
    profile: str
    isolation: str
    created_at: float
    expires_at: float
    cap_at: float  # created_at + the profile's limits.ttl: no extension goes past it
    labels: dict[str, str]
    spec: Any = None  # the SandboxSpec it was started with (its scrubber's inputs)
    state: str = "ready"  # ready | frozen | ended
    capped: bool = False
    file_limit: int = 0  # bytes one file read or write may move
    scrubber: Any = None  # its output scrubber, built at the first exec (it looks up names)
    execs: set[Any] = field(default_factory=set)  # the ExecControl of each running exec

    def view(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "profile": self.profile,
                "isolation": self.isolation, "state": self.state,
                "created_at": self.created_at, "expires_at": self.expires_at,
                "labels": dict(self.labels), "execs_running": len(self.execs),
                "capped": self.capped}


def new_row(session_id: str, profile: str, isolation: str, now: float, ttl_s: int | None,
            cap_s: int, labels: dict[str, str], spec: Any = None) -> SessionRow:
    want = ttl_s if ttl_s is not None else cap_s
    return SessionRow(session_id, profile, isolation, now, now + min(want, cap_s),
                      now + cap_s, labels, spec, capped=want > cap_s)


def extend(row: SessionRow, ttl_s: int, now: float) -> SessionRow:
    """Expiry `ttl_s` from now, cut at the cap (then `capped`)."""
    want = now + ttl_s
    row.expires_at = min(want, row.cap_at)
    row.capped = want > row.cap_at
    return row


class SessionTable:
    def __init__(self) -> None:
        self._rows: OrderedDict[str, SessionRow] = OrderedDict()

    def add(self, row: SessionRow) -> None:
        self._rows[row.session_id] = row

    def get(self, session_id: str) -> SessionRow | None:
        return self._rows.get(session_id)

    def rows(self) -> list[SessionRow]:
        return list(self._rows.values())

    def live(self) -> list[SessionRow]:
        return [r for r in self._rows.values() if r.state != "ended"]

    def ended(self, session_id: str) -> None:
        row = self._rows.get(session_id)
        if row is not None:
            row.state = "ended"
        old = [sid for sid, r in self._rows.items() if r.state == "ended"]
        for sid in old[: max(0, len(old) - ENDED_KEPT)]:
            del self._rows[sid]

    def expired(self, now: float) -> list[str]:
        return [r.session_id for r in self.live() if r.expires_at <= now]
