"""The session API's request and response models (pydantic): what `session_routes.py`
accepts and answers, and what `openapi.py` publishes. Validation is here and pure; a
refused body names its first bad field (`field_of`)."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from stockade.tasks.labels import LabelError, check_labels

from .initscript import check_input_target
from .spec import ENV_NAME_RE

MAX_STDIN = 1 * 2**20  # stdin travels inside the JSON body
MAX_ARGV = 4096
SessionState = Literal["ready", "frozen", "ended"]
ErrorCode = Literal["bad_request", "unauthorized", "not_found", "session_ended", "too_large",
                    "path_refused", "profile_unknown", "launcher_error", "busy",
                    "shutting_down", "internal_error"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _no_nul(v: str, what: str) -> str:
    if "\0" in v:
        raise ValueError(f"{what} must not contain NUL")
    return v


def _env(v: dict[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if not ENV_NAME_RE.match(k) or k.startswith("STOCKADE_"):
            raise ValueError(f"invalid environment name {k!r}")
        _no_nul(val, f"env.{k}")
    return v


def _labels(v: Any) -> dict[str, str]:
    try:
        return check_labels(v)
    except LabelError as e:
        raise ValueError(str(e)) from None


EnvAdditions = Annotated[dict[str, str], AfterValidator(_env)]
Labels = Annotated[dict[str, str], BeforeValidator(_labels)]


class InputBind(_Strict):
    host: str = Field(description="absolute host path, bound read-only")
    guest: str = Field(description="absolute path inside the sandbox")

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must be an absolute path")
        return _no_nul(v, "host")

    @field_validator("guest")
    @classmethod
    def _guest(cls, v: str) -> str:
        return check_input_target(v)


class SessionCreate(_Strict):
    profile: str = Field(min_length=1)
    ttl_s: int | None = Field(None, ge=1, description="seconds; capped at the profile's "
                                                     "limits.ttl")
    labels: Labels = Field(default_factory=dict)
    inputs: list[InputBind] = Field(default_factory=list)
    env: EnvAdditions = Field(default_factory=dict)


class Session(BaseModel):
    session_id: str = Field(description="the sandbox's task id")
    profile: str
    isolation: str
    state: SessionState
    created_at: float
    expires_at: float
    labels: dict[str, str]
    execs_running: int
    capped: bool = Field(False, description="a TTL asked for was cut at the profile's cap")


class SessionList(BaseModel):
    sessions: list[Session]


class TtlRequest(_Strict):
    ttl_s: int = Field(ge=1, description="seconds from now; capped at the profile's "
                                         "limits.ttl from creation")


class Killed(BaseModel):
    killed: bool = True


class ExecRequest(_Strict):
    argv: list[str] = Field(min_length=1, max_length=MAX_ARGV)
    env: EnvAdditions = Field(default_factory=dict,
                              description="added to the session's environment")
    cwd: str | None = Field(None, description="relative to the session's scratch")
    stdin: str | None = Field(None, description="UTF-8 text")
    stdin_b64: str | None = Field(None, description="bytes, base64")
    timeout_s: float | None = Field(None, gt=0)
    stream: bool = Field(True, description="false: one JSON object at the end")

    @field_validator("argv")
    @classmethod
    def _argv(cls, v: list[str]) -> list[str]:
        if not v[0]:
            raise ValueError("argv[0] must not be empty")
        return [_no_nul(a, f"argv[{i}]") for i, a in enumerate(v)]

    def stdin_bytes(self) -> bytes | None:
        """stdin as bytes (ValueError: both forms, bad base64, too large)."""
        if self.stdin is not None and self.stdin_b64 is not None:
            raise ValueError("stdin and stdin_b64 exclude each other")
        if self.stdin_b64 is not None:
            try:
                data = base64.b64decode(self.stdin_b64, validate=True)
            except binascii.Error:
                raise ValueError("stdin_b64 is not base64") from None
        else:
            data = self.stdin.encode() if self.stdin is not None else None
        if data is not None and len(data) > MAX_STDIN:
            raise ValueError(f"stdin: at most {MAX_STDIN} bytes")
        return data


class ExecChunk(BaseModel):
    type: Literal["stdout", "stderr"]
    data: str = Field(description="UTF-8 text, scrubbed; invalid bytes become U+FFFD")


class ExecExit(BaseModel):
    type: Literal["exit"] = "exit"
    exit_code: int | None
    ended_by: Literal["exit", "timeout", "killed", "limit"]
    duration_s: float
    denials: list[dict[str, Any]] = Field(description="as RunResult.denials: the events "
                                                      "denied while the exec ran")
    stdout_truncated: bool
    stderr_truncated: bool


class ExecResult(ExecExit):
    stdout: str
    stderr: str


class FileWritten(BaseModel):
    path: str
    size: int


class FileEntry(BaseModel):
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int


class FileList(BaseModel):
    entries: list[FileEntry]


class ErrorBody(BaseModel):
    error: ErrorCode
    detail: str
    field: str | None = None


def field_of(e: ValidationError) -> tuple[str, str]:
    """(the first bad field as a dotted path, its message) of a refused body."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "body"
    return loc, f"{loc}: {err['msg']}"
