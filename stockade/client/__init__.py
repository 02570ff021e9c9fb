"""The Python SDK of Stockade's session API (the launcher's control service): typed,
synchronous (`Sandbox`, `Client`) and asyncio (`AsyncSandbox`, `AsyncClient`).
Refusals raise `StockadeError` subclasses named after the API's stable error codes.
See docs/sdk.md."""

from .aio import AsyncClient, AsyncExecStream, AsyncSandbox
from .denials import denial_summary, summarize_denials
from .errors import (
    BadRequest,
    Busy,
    LauncherFailure,
    NoRecord,
    NotFound,
    PathRefused,
    ProfileUnknown,
    RecordInvalid,
    RecordPending,
    SessionEnded,
    SessionRunning,
    StockadeError,
    TooLarge,
    TransportError,
    Unauthorized,
)
from .models import ExecResult, FileEntry, Output, SessionInfo, TaskRecord, Written
from .sync import Client, ExecStream, Sandbox
from .transport import Endpoint

__all__ = [
    "AsyncClient", "AsyncExecStream", "AsyncSandbox", "BadRequest", "Busy", "Client",
    "Endpoint", "ExecResult", "ExecStream", "FileEntry", "LauncherFailure", "NoRecord",
    "NotFound", "Output", "PathRefused", "ProfileUnknown", "RecordInvalid", "RecordPending",
    "Sandbox", "SessionEnded", "SessionInfo", "SessionRunning", "StockadeError",
    "TaskRecord", "TooLarge", "TransportError", "Unauthorized", "Written",
    "denial_summary", "summarize_denials",
]
