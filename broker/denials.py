"""The broker's one refusal: an exception carrying the HTTP status, the stable reason code
and the message the sandbox sees. Raised by the request steps (server.py) and the body
limits (body.py); the handlers turn it into the JSON denial and its event."""

from __future__ import annotations


class Denied(Exception):
    def __init__(self, status: int, reason: str, message: str, retry_after: float = 0) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
