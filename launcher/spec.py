"""What a caller asks the launcher for and what it gets back: `SandboxSpec`, `RunResult`,
and the checks a spec passes before any piece of a sandbox exists (pure but for `stat`)."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from . import initscript
from .environment import proxy_listen_problem

# orphaned: its `stockade run` died; a reconcile removed it (end events only)
EndedBy = Literal["exit", "ttl", "killed", "limit", "orphaned"]
TASK_ID_RE = re.compile(r"^[0-9a-f]{10}\Z")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")


class LauncherError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    profile: str
    argv: list[str]
    inputs: list[tuple[str, str]] = field(default_factory=list)  # (host path, guest path)
    export_dir: str | None = None
    ttl: int | None = None  # seconds; capped by the profile's limits.ttl
    env: dict[str, str] = field(default_factory=dict)
    stdin: bytes | None = None
    # a session: the sandbox starts with no command (its init holds it until killed) and
    # commands arrive through Backend.exec; argv may then be empty
    session: bool = False
    # the caller's labels (stockade.tasks.labels): in its registration, so every event
    # of the task carries them
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ExportedFile:
    name: str
    size: int
    type: str


@dataclass(slots=True)
class RunResult:
    task_id: str
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    denials: list[dict[str, Any]]
    exports: list[ExportedFile]
    ended_by: EndedBy
    timings: dict[str, float] = field(default_factory=dict)  # setup_s, run_s, teardown_s
    # the output cap (max_output_bytes) cut the stream; *_bytes: what the command wrote
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["exports"] = [asdict(e) for e in self.exports]
        return d


def check_spec(spec: SandboxSpec, profile: Any, proxy_listen: list[str]) -> bool:
    """LauncherError for a spec no sandbox may run; True when the profile wants the
    explicit proxy in the environment (`egress.proxy_env`) and the gateway can give it."""
    if not spec.argv and not spec.session:
        raise LauncherError("empty command")
    for k in spec.env:
        if not ENV_NAME_RE.match(k) or k.startswith("STOCKADE_"):
            raise LauncherError(f"invalid environment name {k!r}")
    proxy_env = bool(getattr(profile, "proxy_env", False))
    if proxy_env:
        problem = proxy_listen_problem(proxy_listen)
        if problem is not None:
            raise LauncherError(f"profile {profile.name!r} sets egress.proxy_env: {problem}")
    return proxy_env


def check_inputs(inputs: list[tuple[str, str]], ro_binds: list[str]) -> list[initscript.Bind]:
    """(host path, guest path) pairs as read-only binds; LauncherError for a missing host
    path or a guest path the sandbox's own layout reserves."""
    out = []
    for host, guest in inputs:
        hp = os.path.realpath(host)
        if not os.path.exists(hp):
            raise LauncherError(f"input does not exist: {host}")
        try:
            initscript.check_input_target(guest, extra=ro_binds)
        except ValueError as e:
            raise LauncherError(str(e)) from None
        out.append(initscript.Bind(hp, guest, is_dir=os.path.isdir(hp)))
    return out
