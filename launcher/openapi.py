"""The OpenAPI 3.1 document of the launcher's control API, built from the pydantic models
of `session_api.py` (pure). Served at `/openapi.json`; the copy committed as
docs/openapi.json is checked against this by a test (regenerate: `python -m
stockade.launcher.openapi > docs/openapi.json`)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import session_api as m

VERSION = "1"
REF = "#/components/schemas/{model}"

# (method, path, summary, request model or body kind, {status: response model or kind})
Route = tuple[str, str, str, Any, dict[int, Any]]
ERRORS = {400: m.ErrorBody, 401: m.ErrorBody, 404: m.ErrorBody, 409: m.ErrorBody}
SID = "/v1/sessions/{session_id}"
ROUTES: list[Route] = [
    ("post", "/v1/sessions", "Create a session (answers once its sandbox is ready)",
     m.SessionCreate, {201: m.Session, 400: m.ErrorBody, 401: m.ErrorBody,
                       503: m.ErrorBody}),
    ("get", "/v1/sessions", "List sessions", None, {200: m.SessionList}),
    ("get", SID, "One session", None, {200: m.Session, 404: m.ErrorBody}),
    ("delete", SID, "Kill a session", None, {200: m.Killed, 404: m.ErrorBody}),
    ("post", SID + "/suspend", "Freeze a session", None, {200: m.Session, **ERRORS}),
    ("post", SID + "/resume", "Thaw a session", None, {200: m.Session, **ERRORS}),
    ("post", SID + "/ttl", "Move a session's expiry (capped at the profile's limits.ttl)",
     m.TtlRequest, {200: m.Session, **ERRORS}),
    ("post", SID + "/exec", "Run a command in the session; streamed as NDJSON (or SSE "
     "with Accept: text/event-stream): ExecChunk lines, then one ExecExit line; "
     "\"stream\": false answers one ExecResult", m.ExecRequest,
     {200: "exec", 429: m.ErrorBody, **ERRORS}),
    ("put", SID + "/files", "Write a file under the session's scratch (?path=REL)", "bytes",
     {200: m.FileWritten, 413: m.ErrorBody, **ERRORS}),
    ("get", SID + "/files", "Read a file (?path=REL: raw bytes) or list a directory "
     "(?list=REL: FileList)", None, {200: "file_or_list", 413: m.ErrorBody, **ERRORS}),
    # the one-shot routes (request format: launcher/run_request.py, docs/launcher.md)
    ("post", "/v1/sandboxes", "Run one command in a fresh sandbox (RunResult; \"wait\": "
     "false answers 202 once it exists)", "object", {200: "object", 202: "object",
                                                    400: m.ErrorBody, 503: m.ErrorBody}),
    ("get", "/v1/sandboxes", "The live sandboxes", None, {200: "object"}),
    ("get", "/v1/sandboxes/{task_id}/result", "A run's result", None,
     {200: "object", 202: "object", 404: m.ErrorBody}),
    ("delete", "/v1/sandboxes/{task_id}", "Kill a sandbox", None,
     {200: "object", 404: m.ErrorBody}),
    ("post", "/v1/sandboxes/{task_id}/suspend", "Freeze a sandbox", None,
     {200: "object", 404: m.ErrorBody}),
    ("post", "/v1/sandboxes/{task_id}/resume", "Thaw a sandbox", None,
     {200: "object", 404: m.ErrorBody}),
    ("get", "/v1/health", "Readiness", None, {200: "object"}),
    ("post", "/v1/reload", "Reload the rules", None, {200: "object", 422: "object"}),
]
MODELS: list[type[BaseModel]] = [
    m.SessionCreate, m.Session, m.SessionList, m.TtlRequest, m.Killed, m.ExecRequest,
    m.ExecChunk, m.ExecExit, m.ExecResult, m.FileWritten, m.FileEntry, m.FileList,
    m.ErrorBody,
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _content(kind: Any) -> dict[str, Any]:
    if kind == "exec":
        return {"application/x-ndjson": {"schema": {"oneOf": [_ref(m.ExecChunk),
                                                              _ref(m.ExecExit)]}},
                "text/event-stream": {"schema": {"type": "string"}},
                "application/json": {"schema": _ref(m.ExecResult)}}
    if kind == "file_or_list":
        return {"application/octet-stream": {"schema": {"type": "string",
                                                        "format": "binary"}},
                "application/json": {"schema": _ref(m.FileList)}}
    if kind == "object":
        return {"application/json": {"schema": {"type": "object"}}}
    if kind == "bytes":
        return {"application/octet-stream": {"schema": {"type": "string",
                                                        "format": "binary"}}}
    return {"application/json": {"schema": _ref(kind)}}


def _parameters(path: str) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = []
    for name in ("session_id", "task_id"):
        if "{" + name + "}" in path:
            params.append({"name": name, "in": "path", "required": True,
                           "schema": {"type": "string", "pattern": "^[0-9a-f]{10}$"}})
    if path.endswith("/files"):
        params += [{"name": n, "in": "query", "required": False, "schema": {"type": "string"},
                    "description": "path relative to the session's scratch"}
                   for n in ("path", "list")]
    return params


def document() -> dict[str, Any]:
    _, schemas = models_json_schema([(x, "validation") for x in MODELS],
                                    ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, body, answers in ROUTES:
        op: dict[str, Any] = {
            "summary": summary, "parameters": _parameters(path),
            "responses": {str(code): {"description": "ok" if code < 300 else "refused",
                                      "content": _content(kind)}
                          for code, kind in answers.items()}}
        if body is not None:
            op["requestBody"] = {"required": True, "content": _content(body)}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Stockade launcher control API", "version": VERSION,
                 "description": "Sessions and one-shot sandboxes. Over TCP every request "
                                "carries `Authorization: Bearer <token>`."},
        "components": {"schemas": schemas.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }


def text() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(text(), end="")
