"""Request bodies under limits known before the first body byte is read.

The broker used to read a whole `/v1/call` body (up to `max_request_bytes`, 16 MiB) and
only then compare it with the grant's `max_body`: 32 held calls of one task drove its RSS
from 67 MB to 823 MB. Now the limit is decided from the task's profile before reading:
`Content-Length` over it is refused before anything is read (and before `100 Continue`
is sent), a chunked body is read up to limit + 1 and cut, and the bytes a task's bodies
hold in memory at once draw from a per-task budget (`BodyBudget`).

`call_doc_limit` and `BodyBudget` are pure; `read_within` only moves bytes. Hand-written:
aiohttp's `client_max_size` is one server-wide cap, not per task or per grant.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.web_request import BaseRequest
from stockade.policy import Reason
from stockade.policy.model import BrokerGrant

from .denials import Denied

CHUNK = 64 * 1024
# a `/v1/call` document around the body: api, method, path, query, headers
ENVELOPE = 64 * 1024
# a body of max_body bytes sent as a JSON string may be escaped up to 6x (`\u0000`)
JSON_EXPANSION = 6
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# request key: a 100 Continue is still owed
EXPECT_KEY: web.RequestKey[bool] = web.RequestKey("stockade_expect_continue", bool)


class BodyLimit(Denied):
    """A body refused: the broker answers `status` with the stable `reason`."""


def too_large() -> BodyLimit:
    return BodyLimit(413, Reason.BODY_TOO_LARGE, "request body too large")


def call_doc_limit(grants: Iterable[BrokerGrant], cap: int) -> int:
    """The largest `/v1/call` document a profile's grants can need (pure): the largest
    grant's `max_body`, fully escaped, plus the envelope; never above the server's cap."""
    largest = max((g.max_body_bytes for g in grants), default=0)
    return min(cap, largest * JSON_EXPANSION + ENVELOPE)


@dataclass
class BodyBudget:
    """Body bytes each task holds in memory at once (pure; the broker's event loop is its
    only user, so no lock)."""

    per_task: int
    held: dict[str, int] = field(default_factory=dict)

    def take(self, task_id: str, n: int) -> None:
        """Charge `n` more bytes to the task, or raise BodyLimit (nothing charged)."""
        mine = self.held.get(task_id, 0)
        if n > self.per_task:  # never fits, however long the task waits
            raise BodyLimit(413, Reason.BODY_TOO_LARGE,
                            "request body over the per-task in-flight body budget")
        if mine + n > self.per_task:
            raise BodyLimit(429, Reason.BODY_MEMORY_LIMIT,
                            "too many body bytes of this task in flight", retry_after=1)
        self.held[task_id] = mine + n

    def give_back(self, task_id: str, n: int) -> None:
        left = self.held.get(task_id, 0) - n
        if left < 0:
            raise ValueError(f"task {task_id!r} gives back more than it holds")
        if left:
            self.held[task_id] = left
        else:
            self.held.pop(task_id, None)


@dataclass
class Reservation:
    """One call's share of its task's budget; `release()` when the call's handler ends."""

    budget: BodyBudget
    task_id: str
    bytes: int = 0

    def take(self, n: int) -> None:
        self.budget.take(self.task_id, n)
        self.bytes += n

    def release(self) -> None:
        n, self.bytes = self.bytes, 0
        if n:
            self.budget.give_back(self.task_id, n)


def defer_continue(request: BaseRequest) -> None:
    """Owe the client its `100 Continue` until `read_within` has checked the limits: a
    refused body is then never sent at all."""
    request[EXPECT_KEY] = True


async def read_within(request: BaseRequest, limit: int, res: Reservation,
                      timeout_s: float) -> bytes:
    """The whole body, at most `limit` bytes, charged to `res`: its Content-Length up front,
    and whatever it grows past that (chunked, or inflated by aiohttp) as it arrives. Raises
    BodyLimit before reading when Content-Length says it will not fit, and TimeoutError
    when the body takes longer than `timeout_s`."""
    declared = request.content_length
    charged = 0
    if declared is not None:
        if declared > limit:
            raise too_large()
        res.take(declared)  # all of it, before a byte is read
        charged = declared
    if request.pop(EXPECT_KEY, False):
        await request.writer.write(CONTINUE)
        request.writer.output_size = 0  # the answer itself has not started
    buf = bytearray()
    async with asyncio.timeout(timeout_s):
        while True:
            chunk = await request.content.read(min(CHUNK, limit + 1 - len(buf)))
            if not chunk:
                return bytes(buf)
            # what is held, not what was declared: aiohttp inflates a gzip/deflate body,
            # so it can outgrow its Content-Length
            if len(buf) + len(chunk) > charged:
                res.take(len(buf) + len(chunk) - charged)
                charged = len(buf) + len(chunk)
            buf += chunk
            if len(buf) > limit:
                raise too_large()


def inflated(request: BaseRequest) -> bool:
    """Whether aiohttp decoded the body's Content-Encoding before anyone reads it (the
    server parser's auto_decompress): the bytes read are no longer in that coding."""
    return bool(request._message.compression)


def body_unread(request: BaseRequest) -> bool:
    """A refused request whose body the client may still be sending: its connection is
    closed after the answer rather than drained."""
    return request.can_read_body and not request.content.is_eof()
