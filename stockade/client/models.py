"""What the launcher API answers, as typed values (pydantic; unknown fields are kept, so
a newer server's additions reach the caller instead of failing validation)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class SessionInfo(_Answer):
    """One session (`GET /v1/sessions/{id}`); `session_id` is the sandbox's task id."""

    session_id: str
    profile: str
    isolation: str
    state: Literal["ready", "frozen", "ended"] | str
    created_at: float
    expires_at: float
    labels: dict[str, str] = Field(default_factory=dict)
    execs_running: int = 0
    capped: bool = False  # POST .../ttl only: the profile's limits.ttl cut the extension


class Output(_Answer):
    """One chunk of an exec's output, in the order the sandbox wrote it."""

    type: Literal["stdout", "stderr"]
    data: str


class ExecResult(_Answer):
    """How an exec ended. `stdout`/`stderr` hold the whole output when the exec was not
    streamed (or the stream was read to its end); `denials` are the events of the fence
    refusing something during this exec (the same objects as a one-shot run's)."""

    exit_code: int | None
    ended_by: str
    duration_s: float = 0.0
    denials: list[dict[str, Any]] = Field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.ended_by == "exit" and self.exit_code == 0


class FileEntry(_Answer):
    name: str
    type: Literal["file", "dir", "symlink", "other"] | str
    size: int = 0


class Written(_Answer):
    path: str
    size: int


class TaskRecord(_Answer):
    """An ended session's signed task record (docs/task-record.md): the DSSE `envelope`
    as the launcher answered it and the `record` it carries. `verified` is True only when
    a signature by the public key the caller gave verified (`key_id` names that key);
    without a key the record is decoded but unverified."""

    envelope: dict[str, Any]
    record: dict[str, Any]
    verified: bool = False
    key_id: str | None = None

    @property
    def task_id(self) -> str | None:
        return self.record.get("task_id")

    @property
    def ended_by(self) -> str | None:
        return self.record.get("ended_by")

    @property
    def exit_code(self) -> int | None:
        return self.record.get("exit_code")

    @property
    def counts(self) -> dict[str, Any]:
        return self.record.get("counts") or {}
