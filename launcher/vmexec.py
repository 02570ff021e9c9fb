"""The host's end of a session microVM's guest agent: one socket (QEMU's chardev of the
agent's virtio-serial port), a demux thread that routes the guest's frames (`vmchannel`) to
the execs they belong to, and `VmExec`, the Popen-shaped handle (`execspec.ExecProc`) each
exec is.

An exec's stdout and stderr are the read ends of pipes; a pump thread per stream writes
what the guest sent into it, so a caller that stops reading one exec's output never stalls
the demux (and every other exec). Whatever the guest sends is untrusted: a frame that breaks
the framing, an exit status that is not one, or a frame for a channel the host never issued
ends the link and every exec on it.

Channel numbers are random (`secrets`), never the guest's to predict: a guest whose kernel
has fallen cannot queue output or an exit for an exec the host is about to start (with
sequential numbers, frames sent ahead for N+1 would sit in the socket and land in the next
exec once the host registered it); a frame for a number not yet issued is a breach, not
output to drop.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import os
import queue
import secrets
import signal
import socket
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from typing import IO

from . import vmchannel as ch
from .execspec import EndedByReport, ExecSpec
from .spec import LauncherError

log = logging.getLogger("stockade.launcher")
# an exec still running when the link ends (the VM was killed or died): it was killed
ENDED_WITH_VM = 128 + signal.SIGKILL
# how many issued channels a link remembers past their exec's end: frames for those are
# dropped (a killed or forgotten exec's late output is legitimate), for any other never
# issued a breach. Bounded so a long session stays O(1) in memory, and safe so: a live
# exec's channel is known through the live execs whatever its age; an honest agent sends
# an exec's last frames within guest_agent.LINGER_S (0.2 s) of its process's end, far less
# time than 4096 more execs take to be issued; and a late frame past the bound is taken
# for a breach, which ends the link: it fails closed and never reaches another exec. A new
# channel is unique among the live and the remembered ones (~250 KB per link at most).
RECENT_CHANNELS = 4096


def exec_payload(req: ExecSpec) -> bytes:
    """The EXEC frame's payload; LauncherError for a request no guest may get (the agent
    checks again: it runs as the guest's root)."""
    if not req.argv or not all(isinstance(a, str) and "\0" not in a for a in req.argv):
        raise LauncherError("an exec needs a command (strings without NUL)")
    cwd = os.path.normpath(req.cwd)
    if cwd != "/scratch" and not cwd.startswith("/scratch/"):
        raise LauncherError(f"exec cwd {req.cwd!r} is not beneath /scratch")
    for k, v in req.env.items():
        if not isinstance(k, str) or not isinstance(v, str) or "\0" in k + v or "=" in k:
            raise LauncherError(f"invalid environment entry {k!r}")
    payload = marshal.dumps({"argv": list(req.argv), "env": dict(req.env), "cwd": cwd,
                             "stdin": req.stdin is not None}, 4)
    if len(payload) > ch.MAX_PAYLOAD:
        raise LauncherError("exec request too large")
    return payload


class _Pump(threading.Thread):
    """Writes one exec stream's chunks into its pipe; None closes it."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def run(self) -> None:
        broken = False
        while (chunk := self.q.get()) is not None:
            if broken:
                continue  # the reader went away: drain, write nothing
            try:
                _write_all(self.fd, chunk)
            except OSError:
                broken = True
        os.close(self.fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class VmExec(EndedByReport):
    """One exec in the guest (`ExecProc`): `pid` is its channel number; the exit status is
    the guest's (128+N when signal N ended it); `oom_kills`/`pids_hits`: the task cgroup's
    counts during it."""

    def __init__(self, link: AgentLink, chan: int) -> None:
        self._link, self.pid = link, chan
        self._init_report()
        self.oom_kills = self.pids_hits = 0
        self._killed = False  # SIGKILL sent: the guest's silence after it ends the exec
        self.refused: str | None = None  # why the agent did not start it
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        self._pumps = {ch.STDOUT: _Pump(out_w), ch.STDERR: _Pump(err_w)}
        for p in self._pumps.values():
            p.start()
        self.stdout: IO[bytes] | None = os.fdopen(out_r, "rb")
        self.stderr: IO[bytes] | None = os.fdopen(err_r, "rb")
        self.stdin: IO[bytes] | None = None  # ExecSpec.stdin is sent whole, then closed

    def send_signal(self, sig: int) -> None:
        """`sig` to the exec's process group in the guest (nothing once it has ended)."""
        if self.returncode is None:
            with contextlib.suppress(OSError, LauncherError):
                self._link.send_frame(ch.encode(self.pid, ch.SIGNAL, str(int(sig)).encode()))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
        self._killed = True

    def wait(self, timeout: float | None = None) -> int:
        """As EndedByReport's; but a killed exec whose guest does not confirm its end in
        `timeout` ends here (ENDED_WITH_VM): a hostile guest that never sends its EXIT
        would otherwise keep its pump threads and pipes for the VM's life."""
        try:
            return super().wait(timeout)
        except subprocess.TimeoutExpired:
            if not self._killed:
                raise
            self._link.forget(self.pid)
            self._end(ENDED_WITH_VM)
            return super().wait(0)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _output(self, kind: int, data: bytes) -> None:
        self._pumps[kind].q.put(data)

    def _end(self, rc: int, ooms: int = 0, pids: int = 0, refused: str | None = None) -> None:
        if self._done.is_set():
            return
        if refused is not None:
            self.refused = refused
            self._output(ch.STDERR, f"stockade: {refused}\n".encode())
        self.oom_kills, self.pids_hits = ooms, pids
        for p in self._pumps.values():
            p.q.put(None)
        self._report_end(rc)


class _Unissued(ch.ChannelError):
    """A frame for a channel the host never issued: the guest is guessing or sending ahead."""


class AgentLink:
    """The connection to one guest's agent. `start` runs the demux; `wait_ready` until the
    agent says it waits; `exec` starts one exec; `close` ends the link (and its execs)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._dec = ch.Decoder(ch.GUEST_TYPES)
        self._send = threading.Lock()
        self._execs: dict[int, VmExec] = {}
        self._recent: deque[int] = deque()  # issued channels, oldest first (RECENT_CHANNELS)
        self._issued: set[int] = set()  # the same, to look up
        self._mu = threading.Lock()
        self.ready = threading.Event()
        self.ended = threading.Event()
        self.broken: str | None = None
        self._thread = threading.Thread(target=self._demux, daemon=True,
                                        name="microvm-agent")

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float, alive: Callable[[], bool]) -> None:
        """Until the agent's READY; LauncherError when the VM ended first or `timeout`
        passed (`alive`: QEMU still runs)."""
        waited = 0.0
        while not self.ready.wait(0.05):
            waited += 0.05
            if self.ended.is_set() or not alive():
                raise LauncherError("the microVM ended before its agent was ready"
                                    + (f" ({self.broken})" if self.broken else ""))
            if waited >= timeout:
                raise LauncherError(f"the microVM's agent was not ready in {timeout:.0f} s")

    def send_frame(self, frame: bytes) -> None:
        if self.ended.is_set():
            raise LauncherError("the session's microVM has ended")
        with self._send:
            try:
                self.sock.sendall(frame)
            except OSError as e:
                raise LauncherError(f"the session's microVM is unreachable: {e}") from None

    def exec(self, req: ExecSpec) -> VmExec:
        payload = exec_payload(req)
        if not self.ready.is_set():
            raise LauncherError("the session's microVM is not ready")
        with self._mu:
            chan = self._new_channel()
            proc = VmExec(self, chan)
            self._execs[chan] = proc
        try:
            self.send_frame(ch.encode(chan, ch.EXEC, payload))
            if req.stdin is not None:  # then its end: the command reads EOF
                for frame in [*ch.chunks(chan, ch.STDIN, req.stdin), ch.encode(chan, ch.STDIN)]:
                    self.send_frame(frame)
        except LauncherError:
            with self._mu:
                self._execs.pop(chan, None)
            proc._end(ENDED_WITH_VM)
            raise
        return proc

    def _new_channel(self) -> int:
        """A random non-zero channel, neither live nor recently issued (`_mu` held)."""
        while True:
            chan = secrets.randbits(32)
            if chan and chan not in self._execs and chan not in self._issued:
                break
        if len(self._recent) >= RECENT_CHANNELS:
            self._issued.discard(self._recent.popleft())
        self._recent.append(chan)
        self._issued.add(chan)
        return chan

    def forget(self, chan: int) -> None:
        """Frames for `chan` are dropped from now on (its exec was ended host-side)."""
        with self._mu:
            self._execs.pop(chan, None)

    def running(self) -> int:
        with self._mu:
            return len(self._execs)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._finish(None)
        with contextlib.suppress(OSError):
            self.sock.close()

    def _demux(self) -> None:
        why: str | None = None
        try:
            while data := self.sock.recv(256 * 1024):
                for chan, kind, payload in self._dec.feed(data):
                    self._route(chan, kind, payload)
        except _Unissued as e:
            why = f"the guest agent broke the protocol: {e}"
        except ch.ChannelError as e:
            why = f"the guest agent broke its framing: {e}"
        except OSError:
            pass
        self._finish(why)

    def _route(self, chan: int, kind: int, payload: bytes) -> None:
        if chan == 0:
            if kind == ch.READY:
                self.ready.set()
            return
        with self._mu:
            proc = self._execs.get(chan)
            if proc is None and chan not in self._issued:
                raise _Unissued(f"a frame (type {kind}) for channel {chan}, never issued")
        if proc is None:
            return  # output of an exec already ended or forgotten: dropped
        if kind in (ch.STDOUT, ch.STDERR):
            proc._output(kind, payload)
            return
        status = ch.parse_exit(payload) if kind == ch.EXIT else None  # ChannelError first
        with self._mu:
            self._execs.pop(chan, None)
        if status is not None:
            proc._end(*status)
        else:  # ERROR: the agent refused the request
            proc._end(126, refused=payload.decode("utf-8", "replace")[:500])

    def _finish(self, why: str | None) -> None:
        if why is not None and self.broken is None:
            self.broken = why
            log.warning("microVM agent link ended: %s", why)
        self.ended.set()
        with self._mu:
            left, self._execs = list(self._execs.values()), {}
        for proc in left:
            proc._end(ENDED_WITH_VM)
