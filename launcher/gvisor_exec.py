"""The launcher's end of a gVisor session's exec server (`gvisor_execd.py`, inside the
sandbox): one `runsc exec` per session whose stdin and stdout carry the frames of every
exec; each exec is a `ServerExec`, Popen-shaped (`execspec.ExecProc`), whose stdout and
stderr are host pipes this end fills from the frames.

A kill asks the server to SIGKILL the exec's pid 1 (its pid namespace goes with it). The
execs cannot signal the server (it is outside their pid namespaces, and it holds a
capability they lack, so no ptrace or /proc/<pid>/mem either), but a server that hangs or
dies must not leave an exec running: a kill it does not answer within KILL_GRACE_S, and
every exec still running when its pipe closes, is ended by `runsc kill --pid` of that
pid 1 from the host, and a server that did not answer is replaced.
"""

from __future__ import annotations

import contextlib
import itertools
import marshal
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from . import gvisor_execd as wire
from .execspec import EndedByReport
from .spec import LauncherError

READY_TIMEOUT_S = 30.0
KILL_GRACE_S = 2.0
KILLED = 137


class _Stdin:
    """An exec's stdin as a writable file: each write is one or more I frames, close an E."""

    def __init__(self, server: GuestExecServer, rid: int) -> None:
        self.server, self.rid, self.closed = server, rid, False

    def write(self, data: bytes) -> int:
        if self.closed:
            raise ValueError("write to a closed stdin")
        for i in range(0, len(data), wire.READ_SIZE):
            self.server.send(self.rid, b"I", bytes(data[i:i + wire.READ_SIZE]))
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(LauncherError):
                self.server.send(self.rid, b"E")


class ServerExec(EndedByReport):
    """One exec of the server (poll and wait as the other tiers' reported execs): its
    pipes, its sandbox pid (pid 1 of its namespace), its end."""

    def __init__(self, server: GuestExecServer, rid: int, stdin: bool) -> None:
        self.server, self.rid = server, rid
        r_out, self._w_out = os.pipe()
        r_err, self._w_err = os.pipe()
        self.stdout: IO[bytes] | None = os.fdopen(r_out, "rb")
        self.stderr: IO[bytes] | None = os.fdopen(r_err, "rb")
        self.stdin: IO[bytes] | None = _Stdin(server, rid) if stdin else None  # type: ignore[assignment]
        self.pid = 0  # its pid 1 in the sandbox's pid namespace, once started
        self._init_report()
        self.started = threading.Event()
        self._lock = threading.Lock()

    def kill(self) -> None:
        with contextlib.suppress(LauncherError):
            self.server.send(self.rid, b"K")
        if not self._done.wait(KILL_GRACE_S):
            self.server.kill_from_host(self)
            self.server.retire()

    def _out(self, kind: bytes, data: bytes) -> None:
        fd = self._w_out if kind == b"O" else self._w_err
        with contextlib.suppress(OSError):  # the reader went away: the bytes are dropped
            _write_all(fd, data)

    def _end(self, status: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            for fd in (self._w_out, self._w_err):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._report_end(status)
        self.started.set()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class GuestExecServer:
    """A running exec server: `proc` is its `runsc exec`; `kill_pid(pid)` is the host's
    `runsc kill --pid=<pid> <sandbox> KILL`."""

    def __init__(self, proc: subprocess.Popen[bytes], kill_pid: Callable[[int], None],
                 pidfile: Path) -> None:
        self.proc, self.kill_pid, self.pidfile = proc, kill_pid, pidfile
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._execs: dict[int, ServerExec] = {}
        self._err = b""
        threading.Thread(target=self._drain_stderr, daemon=True,
                         name="stockade-gv-execd-err").start()
        self._await_ready()
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="stockade-gv-execd")
        self._reader.start()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        while chunk := self.proc.stderr.read1(4096):  # type: ignore[attr-defined]
            self._err = (self._err + chunk)[-2000:]

    def _await_ready(self) -> None:
        assert self.proc.stdout is not None
        fd, got = self.proc.stdout.fileno(), b""
        end = time.monotonic() + READY_TIMEOUT_S
        while len(got) < len(wire.READY):
            left = end - time.monotonic()
            chunk = os.read(fd, len(wire.READY) - len(got)) if left > 0 and select.select(
                [fd], [], [], left)[0] else b""
            if not chunk:
                break
            got += chunk
        if got != wire.READY:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.wait(5)
            err = self._err.decode(errors="replace").strip()[-300:]
            raise LauncherError(f"the session's gVisor exec server did not start: "
                                f"{err or 'no output'}")

    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def send(self, rid: int, kind: bytes, payload: bytes = b"") -> None:
        assert self.proc.stdin is not None
        try:
            with self._send_lock:
                self.proc.stdin.write(wire.frame(rid, kind, payload))
                self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise LauncherError(f"the session's exec server is gone: {e}") from None

    def start(self, argv: list[str], env: dict[str, str], cwd: str,
              stdin: bool) -> ServerExec:
        ex = ServerExec(self, next(self._ids), stdin)
        self._execs[ex.rid] = ex
        req = marshal.dumps({"argv": argv, "env": env, "cwd": cwd, "stdin": stdin}, 4)
        try:
            self.send(ex.rid, b"S", req)
        except LauncherError:
            self._execs.pop(ex.rid, None)
            ex._end(KILLED)
            raise
        if not ex.started.wait(READY_TIMEOUT_S):
            self.kill_from_host(ex)
            self.retire()  # a server that does not answer is not asked again
            raise LauncherError("the session's exec server did not start the command")
        return ex

    def kill_from_host(self, ex: ServerExec) -> None:
        """The exec's pid 1 SIGKILLed through runsc (the server did not end it)."""
        if ex.pid > 0 and ex.returncode is None:
            with contextlib.suppress(LauncherError, OSError, subprocess.TimeoutExpired):
                self.kill_pid(ex.pid)
        self._execs.pop(ex.rid, None)
        ex._end(KILLED)

    def retire(self) -> None:
        """A server that did not answer a kill is not used again: its process in the
        sandbox is SIGKILLed through runsc (the next exec starts a new one)."""
        with contextlib.suppress(OSError, ValueError, LauncherError,
                                 subprocess.TimeoutExpired):
            self.kill_pid(int(self.pidfile.read_text().strip()))
        with contextlib.suppress(OSError):
            self.proc.kill()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd, buf = self.proc.stdout.fileno(), b""
        try:
            while chunk := os.read(fd, 1 << 16):
                frames, buf = wire.unframe(buf + chunk)
                for rid, kind, payload in frames:
                    self._dispatch(rid, kind, payload)
        except (OSError, ValueError):  # a frame no server of ours sends: it is not trusted
            with contextlib.suppress(OSError):
                self.proc.kill()
        # the server is gone: what it ran must not live on without it
        for ex in list(self._execs.values()):
            self.kill_from_host(ex)

    def _dispatch(self, rid: int, kind: bytes, payload: bytes) -> None:
        ex = self._execs.get(rid)
        if ex is None:
            return
        if kind == b"P":
            ex.pid = int(payload)
            ex.started.set()
        elif kind in (b"O", b"R"):
            ex._out(kind, payload)
        elif kind == b"X":
            self._execs.pop(rid, None)
            ex._end(int(payload))

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._reader.join(5)
        self.pidfile.unlink(missing_ok=True)
