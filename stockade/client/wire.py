"""The launcher API's requests and answers without any I/O (sans-IO): the sync and the
asyncio client only send a `Call` and hand the answer to the decoders here, so both
speak exactly the same protocol.

An exec answers in NDJSON: `{"type": "stdout"|"stderr", "data": ...}` lines, then exactly
one `{"type": "exit", ...}` line; or, asked for with `Accept: text/event-stream`, the same
objects as server-sent events (`event: <type>`, `data: <json>`). `ExecDecoder` turns the
NDJSON bytes, however they are cut into chunks, or the events (parsed by httpx-sse in the
shells) into `Output` values and the final `ExecResult`; a stream that ends before its
exit, or carries a line or an event that is not the API's, is a `TransportError` (never a
made-up result).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from .errors import StockadeError, TransportError, error_from_body
from .models import ExecResult, FileEntry, Output, SessionInfo, Written

C = TypeVar("C")
MAX_LINE = 8 * 2**20  # one NDJSON line; the server's output cap is far below


@dataclass(frozen=True, slots=True)
class Call:
    method: str
    path: str
    params: dict[str, str] = field(default_factory=dict)
    json: dict[str, Any] | None = None
    content: bytes | None = None
    stream: bool = False  # an exec: read the answer line by line
    long: bool = False  # the answer takes as long as the work: no read timeout
    sse: bool = False  # an exec streamed as server-sent events instead of NDJSON


def _sid(session_id: str) -> str:
    # a session id is the task id (hex); quoting keeps any other string inside one segment
    return quote(session_id, safe="")


def create(profile: str, *, ttl_s: int | None = None, labels: dict[str, str] | None = None,
           env: dict[str, str] | None = None,
           inputs: list[tuple[str, str]] | None = None) -> Call:
    body: dict[str, Any] = {"profile": profile}
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    if labels:
        body["labels"] = dict(labels)
    if env:
        body["env"] = dict(env)
    if inputs:
        body["inputs"] = [{"host": h, "guest": g} for h, g in inputs]
    return Call("POST", "/v1/sessions", json=body, long=True)


def get(session_id: str) -> Call:
    return Call("GET", f"/v1/sessions/{_sid(session_id)}")


def list_sessions() -> Call:
    return Call("GET", "/v1/sessions")


def kill(session_id: str) -> Call:
    return Call("DELETE", f"/v1/sessions/{_sid(session_id)}", long=True)


def op(session_id: str, name: str) -> Call:
    """suspend or resume"""
    return Call("POST", f"/v1/sessions/{_sid(session_id)}/{name}", long=True)


def extend(session_id: str, ttl_s: int) -> Call:
    return Call("POST", f"/v1/sessions/{_sid(session_id)}/ttl", json={"ttl_s": ttl_s})


def exec_call(session_id: str, argv: list[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None, stdin: str | bytes | None = None,
              timeout_s: float | None = None, sse: bool = False) -> Call:
    # a lone string is refused, not split: "ls -l" is one program name, never a shell line
    if isinstance(argv, str | bytes) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv must be a non-empty list of strings")
    body: dict[str, Any] = {"argv": list(argv)}
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if isinstance(stdin, bytes):
        body["stdin_b64"] = base64.b64encode(stdin).decode()
    elif stdin is not None:
        body["stdin"] = stdin
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    return Call("POST", f"/v1/sessions/{_sid(session_id)}/exec", json=body, stream=True,
                long=True, sse=sse)


def record(session_id: str) -> Call:
    # a session just killed: the answer waits for its teardown to write the record
    return Call("GET", f"/v1/sessions/{_sid(session_id)}/record", long=True)


def write_file(session_id: str, path: str, data: bytes | str) -> Call:
    if isinstance(data, str):
        content = data.encode()
    elif isinstance(data, bytes | bytearray | memoryview):
        content = bytes(data)
    else:  # bytes(5) would be five zero bytes, not an error
        raise TypeError(f"file data must be bytes or str, not {type(data).__name__}")
    return Call("PUT", f"/v1/sessions/{_sid(session_id)}/files", params={"path": path},
                content=content, long=True)


def read_file(session_id: str, path: str) -> Call:
    return Call("GET", f"/v1/sessions/{_sid(session_id)}/files", params={"path": path},
                long=True)


def list_files(session_id: str, path: str = ".") -> Call:
    return Call("GET", f"/v1/sessions/{_sid(session_id)}/files", params={"list": path})


# -- answers --------------------------------------------------------------------------------
def check(status: int, body: bytes) -> bytes:
    """The body of a success; a refusal raises its error class."""
    if status < 300:
        return body
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = body[:200].decode("utf-8", "replace")
    raise error_from_body(status, parsed)


def as_json(status: int, body: bytes) -> dict[str, Any]:
    raw = check(status, body)
    try:
        parsed = json.loads(raw) if raw else {}
    except ValueError:
        raise TransportError(f"answer is not JSON: {raw[:200]!r}", status=status) from None
    if not isinstance(parsed, dict):
        raise TransportError(f"answer is not a JSON object: {raw[:200]!r}", status=status)
    return parsed


def _model(cls: Any, data: Any, what: str) -> Any:
    from pydantic import ValidationError

    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise TransportError(f"{what} does not have the API's shape: {e}") from None


def session(status: int, body: bytes) -> SessionInfo:
    return _model(SessionInfo, as_json(status, body), "session")  # type: ignore[no-any-return]


def _items(status: int, body: bytes, key: str, cls: Any, what: str) -> list[Any]:
    items = as_json(status, body).get(key)
    if not isinstance(items, list):
        raise TransportError(f"{what} list has no {key!r} array")
    return [_model(cls, d, what) for d in items]


def sessions(status: int, body: bytes) -> list[SessionInfo]:
    return _items(status, body, "sessions", SessionInfo, "session")


def written(status: int, body: bytes) -> Written:
    return _model(Written, as_json(status, body), "write answer")  # type: ignore[no-any-return]


def entries(status: int, body: bytes) -> list[FileEntry]:
    return _items(status, body, "entries", FileEntry, "file entry")


# -- the exec stream ------------------------------------------------------------------------
class ExecDecoder:
    """NDJSON bytes in, `Output` chunks out, then the `ExecResult` (`.result`) with the
    output joined, once the exit line has arrived."""

    def __init__(self, *, keep: bool = True) -> None:
        self._buf = bytearray()
        self._keep = keep  # join the output into the result (off: the caller streams it)
        self._out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.result: ExecResult | None = None

    def feed(self, data: bytes) -> list[Output]:
        self._buf += data
        out: list[Output] = []
        while (nl := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            chunk = self._line(line)
            if chunk is not None:
                out.append(chunk)
        if len(self._buf) > MAX_LINE:
            raise TransportError(f"exec stream line longer than {MAX_LINE} bytes")
        return out

    def close(self) -> ExecResult:
        """The end of the stream: the result, or TransportError when it was cut short."""
        if self._buf.strip():
            self.feed(b"\n")  # a last line without its newline
        if self.result is None:
            raise TransportError("exec stream ended before its exit line")
        return self.result

    def event(self, name: str, data: str) -> Output | None:
        """One server-sent event (its `event:` name and `data:`): the same object as an
        NDJSON line, whose `type` must be the event's name."""
        obj = self._parse(data.encode(), "event")
        if not isinstance(obj, dict) or obj.get("type") != name:
            raise TransportError(f"exec event {name!r} carries another type: {data[:200]!r}")
        return self._object(obj, data.encode())

    def _line(self, line: bytes) -> Output | None:
        if not line.strip():
            return None
        return self._object(self._parse(line, "line"), line)

    def _parse(self, raw: bytes, what: str) -> Any:
        if self.result is not None:
            raise TransportError(f"exec stream has data after its exit {what}")
        try:
            return json.loads(raw)
        except ValueError:
            raise TransportError(f"exec stream {what} is not JSON: {raw[:200]!r}") from None

    def _object(self, obj: Any, line: bytes) -> Output | None:
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind in ("stdout", "stderr"):
            chunk: Output = _model(Output, obj, "exec output")
            if self._keep:
                self._out[kind].append(chunk.data)
            return chunk
        if kind == "exit":
            joined = {k: "".join(v) for k, v in self._out.items()}
            self.result = _model(ExecResult, {**obj, **joined} if self._keep else obj,
                                 "exec exit")
            return None
        if kind == "error":  # a refusal after the answer had started
            raise error_from_body(None, obj)
        raise TransportError(f"exec stream line of unknown type: {line[:200]!r}")


class Handle(Generic[C]):
    """What a sync or an asyncio sandbox object holds: its client, the session as last
    seen, its `files` (of the class `files_class`), and whether it opened that client
    (and so closes it)."""

    files_class: Any

    def __init__(self, client: C, info: SessionInfo, *, owns_client: bool = False) -> None:
        self.client = client
        self.info = info
        self.files = self.files_class(self)
        self._owns_client = owns_client

    @property
    def id(self) -> str:
        return self.info.session_id


class ExecState:
    """What a sync or an asyncio exec stream keeps: the call, its decoder, its result."""

    def __init__(self, call: Call, *, keep: bool) -> None:
        self.call = call
        self.decoder = ExecDecoder(keep=keep)
        self._result: ExecResult | None = None
        self._started = False

    def begin(self) -> None:
        if self._started:
            raise RuntimeError("an exec stream can be read once")
        self._started = True

    def finish(self) -> None:
        self._result = self.decoder.close()

    @property
    def result(self) -> ExecResult:
        if self._result is None:
            raise RuntimeError("the exec stream has not been read to its end")
        return self._result


def exec_result(status: int, body: bytes) -> ExecResult:
    """A whole exec answer read at once (the NDJSON stream, not split)."""
    check(status, body)
    dec = ExecDecoder()
    dec.feed(body)
    return dec.close()


__all__ = ["Call", "ExecDecoder", "ExecState", "Handle", "StockadeError"]
