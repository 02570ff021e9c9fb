"""The launcher control API's request format, pure: `POST /v1/sandboxes` bodies parsed into a
`SandboxSpec` (every field checked, the first bad one named) and its inverse, and
`RunResult` back from JSON. The service (`service.py`) only moves these over the socket."""

from __future__ import annotations

import os
from collections.abc import Container
from typing import Any

from stockade.tasks.labels import LabelError, check_labels

from .initscript import check_input_target
from .spec import ENV_NAME_RE, ExportedFile, RunResult, SandboxSpec

MAX_ARGV = 4096
MAX_STDIN = 256 * 1024  # stdin travels inside the JSON body
TRUNCATION_FIELDS = ("stdout_truncated", "stderr_truncated", "stdout_bytes", "stderr_bytes")
RUN_FIELDS = frozenset({"profile", "argv", "inputs", "ttl", "env", "export_dir", "stdin",
                        "wait", "labels"})
class RequestError(ValueError):
    """A request the service refuses (400); `field` names the offending key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _text(value: Any, name: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RequestError(name, "must be a string")
    if "\0" in value:
        raise RequestError(name, "must not contain NUL")
    if not value and not allow_empty:
        raise RequestError(name, "must not be empty")
    return value


def _abs_path(value: Any, name: str) -> str:
    # the service's cwd means nothing to the client: only absolute host paths
    p = _text(value, name)
    if not p.startswith("/"):
        raise RequestError(name, f"must be an absolute path, got {p!r}")
    return p


def _input(item: Any, i: int) -> tuple[str, str]:
    name = f"inputs[{i}]"
    if isinstance(item, str):  # like `stockade run --input HOST`: guest /inputs/<basename>
        host = _abs_path(item, name)
        base = os.path.basename(os.path.normpath(host))
        if not base or base == "/":
            raise RequestError(name, "the root directory needs an explicit guest path")
        guest = "/inputs/" + base
    elif isinstance(item, list) and len(item) == 2:
        host = _abs_path(item[0], f"{name}[0]")
        guest = _text(item[1], f"{name}[1]")
    else:
        raise RequestError(name, "must be a host path or a [host path, guest path] pair")
    try:
        check_input_target(guest)
    except ValueError as e:
        raise RequestError(name, str(e)) from None
    return host, guest


def _profile(body: dict[str, Any], profiles: Container[str] | None) -> str:
    if "profile" not in body:
        raise RequestError("profile", "is required")
    profile = _text(body["profile"], "profile")
    if profiles is not None and profile not in profiles:
        raise RequestError("profile", f"unknown profile {profile!r}")
    return profile


def _argv(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise RequestError("argv", "must be a non-empty list of strings")
    if len(value) > MAX_ARGV:
        raise RequestError("argv", f"at most {MAX_ARGV} items")
    return [_text(a, f"argv[{i}]", allow_empty=i > 0) for i, a in enumerate(value)]


def _inputs(value: Any) -> list[tuple[str, str]]:
    raw = value or []
    if not isinstance(raw, list):
        raise RequestError("inputs", "must be a list")
    return [_input(item, i) for i, item in enumerate(raw)]


def _ttl(ttl: Any) -> int | None:
    # bool is an int subclass: `"ttl": true` is a mistake, not one second
    if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 1):
        raise RequestError("ttl", "must be a positive integer (seconds) or null")
    return ttl


def _env(value: Any) -> dict[str, str]:
    raw = value or {}
    if not isinstance(raw, dict):
        raise RequestError("env", "must be an object of name: value strings")
    env: dict[str, str] = {}
    for k, v in raw.items():
        if not ENV_NAME_RE.match(k) or k.startswith("STOCKADE_"):
            raise RequestError("env", f"invalid environment name {k!r}")
        env[k] = _text(v, f"env.{k}", allow_empty=True)
    return env


def _stdin(stdin: Any) -> bytes | None:
    if stdin is None:
        return None
    if not isinstance(stdin, str):
        raise RequestError("stdin", "must be a string (UTF-8 text) or null")
    data = stdin.encode("utf-8")
    if len(data) > MAX_STDIN:
        raise RequestError("stdin", f"at most {MAX_STDIN} bytes")
    return data


def parse_run_request(
    body: Any, profiles: Container[str] | None = None
) -> tuple[SandboxSpec, bool]:
    """Validate a `POST /v1/sandboxes` body; returns (spec, wait) or raises RequestError.

    Every check that needs no I/O happens here, so a bad request is refused before any
    sandbox piece exists. `profiles`: the names the rules in force define (None: unchecked).
    The fields are checked in a fixed order: the first bad one is the one reported.
    """
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - RUN_FIELDS)
    if unknown:
        raise RequestError(unknown[0], f"unknown field (allowed: {', '.join(sorted(RUN_FIELDS))})")
    profile = _profile(body, profiles)
    argv = _argv(body.get("argv"))
    inputs = _inputs(body.get("inputs"))
    ttl = _ttl(body.get("ttl"))
    env = _env(body.get("env"))
    export_dir = body.get("export_dir")
    if export_dir is not None:
        export_dir = _abs_path(export_dir, "export_dir")
    stdin = _stdin(body.get("stdin"))
    wait = body.get("wait", True)
    if not isinstance(wait, bool):
        raise RequestError("wait", "must be true or false")
    try:
        labels = check_labels(body.get("labels"))
    except LabelError as e:
        raise RequestError("labels", str(e)) from None
    spec = SandboxSpec(profile=profile, argv=argv, inputs=inputs, export_dir=export_dir,
                       ttl=ttl, env=env, stdin=stdin, labels=labels)
    return spec, wait


def run_request(spec: SandboxSpec, *, wait: bool = True) -> dict[str, Any]:
    """The JSON body of `POST /v1/sandboxes` for `spec` (the inverse of parse_run_request)."""
    body: dict[str, Any] = {"profile": spec.profile, "argv": list(spec.argv),
                            "inputs": [[h, g] for h, g in spec.inputs], "ttl": spec.ttl,
                            "env": dict(spec.env), "export_dir": spec.export_dir,
                            "wait": wait}
    if spec.labels:
        body["labels"] = dict(spec.labels)
    if spec.stdin is not None:
        body["stdin"] = spec.stdin.decode("utf-8")  # UnicodeDecodeError: not sendable as text
    return body


def result_from_json(d: dict[str, Any]) -> RunResult:
    """RunResult from `RunResult.to_json()` (unknown keys of a newer service are ignored)."""
    return RunResult(
        task_id=d["task_id"], exit_code=d["exit_code"], stdout=d["stdout"], stderr=d["stderr"],
        duration_s=d["duration_s"], denials=d["denials"],
        exports=[ExportedFile(e["name"], e["size"], e["type"]) for e in d["exports"]],
        ended_by=d["ended_by"], timings=d.get("timings", {}),
        **{k: d[k] for k in TRUNCATION_FIELDS if k in d},
    )
