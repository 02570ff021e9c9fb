"""The launcher API's refusals as exceptions, one class per stable error code.

The service answers every refusal with `{"error": CODE, "detail": str, "field"?: str}`;
callers branch on the class (or on `.code`), never on the wording of `.detail`. A code
this SDK does not know yet still raises `StockadeError` with that code, so a newer
server never turns a refusal into a crash of the client.
"""

from __future__ import annotations

from typing import Any


class StockadeError(Exception):
    """A refusal of the launcher API (or a transport failure: `TransportError`)."""

    code = "error"

    def __init_subclass__(cls, code: str | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if code is not None:
            cls.code = code

    def __init__(self, detail: str, *, code: str | None = None, status: int | None = None,
                 field: str | None = None, body: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        self.status = status
        self.field = field
        self.body = body or {}

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        return f"{self.code}: {self.detail}{where}"


# one class per stable code, so `except NotFound:` reads as what it handles
class BadRequest(StockadeError, code="bad_request"): ...
class Unauthorized(StockadeError, code="unauthorized"): ...
class NotFound(StockadeError, code="not_found"): ...
class SessionEnded(StockadeError, code="session_ended"): ...
class TooLarge(StockadeError, code="too_large"): ...
class PathRefused(StockadeError, code="path_refused"): ...
class ProfileUnknown(StockadeError, code="profile_unknown"): ...
class LauncherFailure(StockadeError, code="launcher_error"): ...
class Busy(StockadeError, code="busy"): ...
# GET .../record: the session still runs / left no record / its teardown is not done
class SessionRunning(StockadeError, code="session_running"): ...
class NoRecord(StockadeError, code="no_record"): ...
class RecordPending(StockadeError, code="record_pending"): ...


class RecordInvalid(StockadeError, code="record_invalid"):
    """A task record whose envelope is malformed or whose signature does not verify with
    the key given (the SDK's own verdict, not a refusal of the launcher)."""


class TransportError(StockadeError, code="transport"):
    """The launcher could not be reached, or its answer was not the API's (a broken
    stream, a body that is not JSON)."""


CODES: dict[str, type[StockadeError]] = {
    c.code: c for c in (BadRequest, Unauthorized, NotFound, SessionEnded, TooLarge,
                        PathRefused, ProfileUnknown, LauncherFailure, Busy, SessionRunning,
                        NoRecord, RecordPending)
}


def error_from_body(status: int | None, body: Any) -> StockadeError:
    """The exception for a refusal: `body` as the service sent it (a dict, or anything
    else a proxy in between may have answered)."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), str):
        text = body if isinstance(body, str) else repr(body)
        return StockadeError(f"HTTP {status}: {text[:200]}", code=f"http_{status}",
                             status=status)
    code = body["error"]
    detail = body.get("detail")
    field = body.get("field")
    cls = CODES.get(code, StockadeError)
    return cls(detail if isinstance(detail, str) else code, code=code, status=status,
               field=field if isinstance(field, str) else None, body=body)
