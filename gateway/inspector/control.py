"""Messages from the gateway to its inspector child, on the child's stdin (pure).

The child's stdin carries its spec (the first line) and stays open: its EOF tells the
child to exit. After the spec, each further line is one JSON control message; today the
only one is `{"end_task": ID}` (the task was deregistered: the child writes its pending
summaries and `event_totals` for it, see EventWriter.end_task). Hand-written because it is
a line splitter over a pipe the gateway alone writes; it still fails closed: a line that
is too long or not a message is skipped (and counted), never half-acted on.
"""

from __future__ import annotations

import json

MAX_LINE = 1024  # a message is a short JSON object; anything longer is not one of ours
MAX_TASK_ID = 256


def end_task_line(task_id: str) -> bytes:
    """The line that tells the child the task `task_id` has ended."""
    return json.dumps({"end_task": task_id}).encode() + b"\n"


def parse_line(line: bytes) -> str | None:
    """The task id of an `end_task` line; None for anything else."""
    try:
        msg = json.loads(line)
    except ValueError:  # includes UnicodeDecodeError
        return None
    if not isinstance(msg, dict):
        return None
    task_id = msg.get("end_task")
    if isinstance(task_id, str) and 0 < len(task_id) <= MAX_TASK_ID:
        return task_id
    return None


class ControlLines:
    """Splits the bytes read from stdin into messages; `bad` counts skipped lines."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skipping = False  # inside an over-long line: drop up to its newline
        self.bad = 0

    def feed(self, data: bytes) -> list[str]:
        """The task ids of the `end_task` messages completed by `data`, in order."""
        self._buf += data
        out: list[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > MAX_LINE:
                    if not self._skipping:
                        self.bad += 1
                    self._skipping = True
                    self._buf.clear()
                return out
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if self._skipping:
                self._skipping = False
                continue
            if not line.strip():
                continue
            task_id = parse_line(line) if len(line) <= MAX_LINE else None
            if task_id is None:
                self.bad += 1
            else:
                out.append(task_id)
