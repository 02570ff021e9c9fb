"""The relay's shell around `tls_retry.RetryWatch`: a watched TLS tunnel's first moves.

Until the server's first handshake message is judged, no client byte after the first
ClientHello goes upstream: the upload pump registers nothing, so the client's bytes wait
in the kernel (those already read with the first flight wait in `held`). The download
pump peeks (MSG_PEEK) at the server's first bytes, so in the common case (a ServerHello
that is no retry, judged from one peek) they are then spliced as before, and the upload
pump starts reading the client exactly when it would have: no extra loop registration.
After a HelloRetryRequest the upload pump reads the client in copy mode into `held`
until the watcher judged the second ClientHello: OK forwards `held` and both pumps are
plain again; a refusal ends the relay with `HelloRetryRefused` (nothing of it went up).
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from .relay_pump import CHUNK, UploadLimit
from .sniff_common import NeedMore
from .tls_retry import Refused, RetryWatch, Step

if TYPE_CHECKING:
    from .relay_pump import Pump

# the server's first bytes looked at without reading them: a record header and a whole
# ServerHello head (5 + 38) with room to spare
PEEK_BYTES = 64


class HelloRetryRefused(Exception):
    """What the client sent after a HelloRetryRequest is refused (`refused` says why)."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(refused.detail)
        self.refused = refused


class RetryGate:
    """One watched tunnel. `early`: the client's bytes read after its first ClientHello
    (already counted against the upload cap): held like the ones still unread."""

    def __init__(self, watch: RetryWatch, early: bytes = b"") -> None:
        self.watch = watch
        self.holding = True  # the server's first message is not judged: client unread
        self.judging = False  # after a retry: client bytes go into `held` and are judged
        self.held = bytearray(early)  # client bytes not yet forwarded
        self.early = len(early)
        self.uncounted = 0  # of `held`: read while judging (not in the relay's bytes_up)
        self.up: Pump | None = None  # the upload pump (set by Relay.run)

    def step(self, pump: Pump) -> str | None:
        """Before `pump` moves bytes: what it does instead ("read", "write", "hold",
        "eof"), or None: go on as an ungated pump (it no longer asks)."""
        return self._up(pump) if pump.up else self._down(pump)

    def _down(self, pump: Pump) -> str | None:
        try:
            data = pump.src.recv(PEEK_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return "read"
        # the server closed before answering: no retry can follow
        step = self.watch.server(data) if data else Step.NO_RETRY
        if step is Step.NEED_MORE:
            # undecided (a fragmented or slow ServerHello): read and relay what was
            # peeked, which the watcher has seen (a level-triggered reader would spin on
            # bytes left unread)
            got = pump.src.recv(len(data))
            pump.pending, pump.chunk = memoryview(got), len(got)
            return pump.send_pending() or "read"
        if isinstance(step, Refused):
            raise HelloRetryRefused(step)
        pump.gate = None  # the server side is decided: relayed as before from here
        self.holding = False
        if step is Step.RETRY:
            self.judging = True
            if self.held:  # the client sent more with its first hello: judged first
                self._verdict(self.watch.client(bytes(self.held)))
        self._wake()
        return None

    def _wake(self) -> None:
        """The upload pump, idle while held: read the client, or send what is held."""
        up = self.up
        if up is None or up.done or up.pending is not None:
            return  # still sending the first hello's rest: it asks again when done
        if self.held and not self.judging:
            # sent from here (the upstream takes them at once, as a rule): no writer
            # registration and no loop round just for them
            up.gate = None
            if self._release(up) == "write":
                up.watch(read=False, write=True)
                return
        up.watch(read=True, write=False)

    def _up(self, pump: Pump) -> str | None:
        if self.holding:
            return "hold"
        if self.judging:
            state = self._judge(pump)
            if state is not None:
                return state
        pump.gate = None  # no retry, or the second hello passed: relayed as before
        return self._release(pump) if self.held else None

    def _release(self, pump: Pump) -> str | None:
        """`held` goes to the upload pump's pending bytes and is sent; "write" when the
        upstream would block (`uncounted` of them are accounted once they are sent)."""
        pump.pending, pump.chunk = memoryview(bytes(self.held)), self.uncounted
        self.held = bytearray()
        return pump.send_pending()

    def _judge(self, pump: Pump) -> str | None:
        """Read the client into `held` until the watcher judged it; None: it passed."""
        while True:
            try:
                data = pump.src.recv(CHUNK)
            except (BlockingIOError, InterruptedError):
                return "read"
            if not data:  # the client gave up: nothing unjudged goes upstream
                self.held.clear()
                return "eof"
            if not pump.relay.count_up(len(data)):
                raise UploadLimit
            self.held += data
            self.uncounted += len(data)
            verdict = self.watch.client(data)
            if not isinstance(verdict, NeedMore):
                self._verdict(verdict)
                return None

    def _verdict(self, verdict: Step | Refused | NeedMore) -> None:
        if isinstance(verdict, Refused):
            self.held.clear()
            raise HelloRetryRefused(verdict)
        if verdict is Step.OK:
            self.judging = False
