"""The guest agent's wire format (pure): length-prefixed frames multiplexed over ONE
virtio-serial port between the launcher and `guest_agent.py` in a microVM.

A frame is a 9-byte header, then the payload:

    length (4 bytes, big endian: the payload's size) | channel (4 bytes) | type (1 byte)

Channel 0 is the agent's own (READY, PLAN, PLANNED); every exec gets a channel the host
chooses (random, non-zero). Both sides import this module: the guest runs it under its init's rules
(builtin modules only, no `__future__`, no dataclasses or typing: each import is read over
9p and run under emulation). Host-to-guest structured payloads are marshal (written by the
launcher, trusted); guest-to-host payloads are bytes or ASCII text only, never unmarshalled:
the guest is the sandbox, and marshal is not safe on hostile input.
"""

HEADER = 9
MAX_PAYLOAD = 1 << 20  # the largest frame either side accepts; output is sent in smaller chunks
CHUNK = 32 * 1024  # what one output frame carries at most
MAX_CHANNEL = (1 << 32) - 1

# host -> guest
EXEC = 1  # marshal {"argv": [str], "env": {str: str}, "cwd": str, "stdin": bool}
STDIN = 2  # bytes for the exec's stdin; an empty payload closes it
SIGNAL = 3  # ASCII signal number, sent to the exec's process group
PLAN = 4  # channel 0: marshal dict, what a waiting (pooled or restored) guest becomes
# guest -> host
STDOUT = 16
STDERR = 17
EXIT = 18  # ASCII "<exit status> <oom kills> <pids limit hits>" (128+N: killed by signal N)
ERROR = 19  # UTF-8 text: a request the agent refused (the channel is then finished)
READY = 20  # channel 0: the agent waits; payload: ASCII "plan" (for its plan) or "exec"
PLANNED = 21  # channel 0: the plan is in force (payload: ASCII "ok" or the reason it is not)

HOST_TYPES = frozenset((EXEC, STDIN, SIGNAL, PLAN))
GUEST_TYPES = frozenset((STDOUT, STDERR, EXIT, ERROR, READY, PLANNED))


class ChannelError(ValueError):
    """A frame the other side must not send: the connection cannot be trusted further."""


def encode(channel: int, kind: int, payload: bytes = b"") -> bytes:
    """One frame. ValueError for a channel, type or payload out of range."""
    if not 0 <= channel <= MAX_CHANNEL:
        raise ValueError(f"channel {channel} out of range")
    if kind not in HOST_TYPES and kind not in GUEST_TYPES:
        raise ValueError(f"unknown frame type {kind}")
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"payload of {len(payload)} bytes over {MAX_PAYLOAD}")
    return (len(payload).to_bytes(4, "big") + channel.to_bytes(4, "big")
            + kind.to_bytes(1, "big") + bytes(payload))


def chunks(channel: int, kind: int, data: bytes) -> list[bytes]:
    """`data` as frames of at most CHUNK bytes each (nothing for empty data)."""
    return [encode(channel, kind, data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]


class Decoder:
    """Incremental: `feed` bytes as they arrive, get whole frames (channel, type, payload)
    back. `accept`: the frame types this side may receive; anything else, or a length past
    MAX_PAYLOAD, raises ChannelError and the decoder stays broken (no resync on a stream
    whose framing is lost)."""

    __slots__ = ("_accept", "_buf", "broken")

    def __init__(self, accept: frozenset[int]) -> None:
        self._buf = bytearray()
        self._accept = frozenset(accept)
        self.broken = False

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        if self.broken:
            raise ChannelError("the channel is broken")
        self._buf += data
        frames = []
        while len(self._buf) >= HEADER:
            length = int.from_bytes(self._buf[0:4], "big")
            kind = self._buf[8]
            if length > MAX_PAYLOAD or kind not in self._accept:
                self.broken = True
                raise ChannelError(f"bad frame (type {kind}, {length} bytes)")
            if len(self._buf) < HEADER + length:
                break
            channel = int.from_bytes(self._buf[4:8], "big")
            frames.append((channel, kind, bytes(self._buf[HEADER:HEADER + length])))
            del self._buf[:HEADER + length]
        return frames

    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)


def exit_text(rc: int, ooms: int, pids: int) -> bytes:
    return f"{rc} {ooms} {pids}".encode()


def parse_exit(payload: bytes) -> tuple[int, int, int]:
    """An EXIT payload as (exit status, OOM kills, pids limit hits); ChannelError when it is
    not three decimal numbers with a status of at most 255."""
    try:
        parts = payload.decode("ascii").split()
    except UnicodeDecodeError:
        parts = []
    if len(parts) != 3 or not all(p.isdigit() and len(p) <= 12 for p in parts):
        raise ChannelError(f"bad exit status {payload[:40]!r}")
    rc, ooms, pids = (int(p) for p in parts)
    if rc > 255:
        raise ChannelError(f"bad exit status {rc}")
    return rc, ooms, pids
