"""The launcher's end of a session's exec server (container tier).

`sandbox_init.py` with a `serve` plan joins the sandbox's cgroups and its init's
namespaces once and then starts one exec per request, so an exec costs three forks
instead of an interpreter start, its imports, the cgroup writes and five setns calls.
Requests go over a SOCK_SEQPACKET socketpair (never a path or a port: nothing in the
sandbox can reach it): a marshalled {id, argv, env, cwd} with the exec's three pipe
ends as SCM_RIGHTS; answers are ("started", id, pid) and ("exit", id, status). Each
exec is a `ServedExec`, Popen-shaped (`execspec.ExecProc`).
"""

from __future__ import annotations

import contextlib
import itertools
import marshal
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import IO

from .execspec import EndedByReport
from .spec import LauncherError

START_TIMEOUT_S = 30.0


class ServedExec(EndedByReport):
    """One exec of an exec server: its pipes, its end as the server reports it."""

    def __init__(self, server: ExecServer, rid: int, stdin: IO[bytes] | None,
                 stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.server, self.rid = server, rid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.pid = 0  # the exec's first process (host pid namespace), once started
        self._init_report()
        self.started = threading.Event()

    def kill(self) -> None:
        self.server.kill(self.rid)

    def _end(self, status: int) -> None:
        self.started.set()
        self._report_end(status)


class ExecServer:
    """A running exec server (`proc`) and its socket; `start` runs one exec."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._execs: dict[int, ServedExec] = {}
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="stockade-exec-server")
        self._reader.start()

    @classmethod
    def spawn(cls, spawn: Callable[[int], subprocess.Popen[bytes]]) -> ExecServer:
        """`spawn(fd)` starts the server process with the far end of a new socketpair."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = spawn(theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours)

    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def start(self, argv: list[str], env: dict[str, str], cwd: str,
              stdin: bool) -> ServedExec:
        r_in, w_in = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        ex = ServedExec(self, next(self._ids), os.fdopen(w_in, "wb") if stdin else None,
                        os.fdopen(r_out, "rb"), os.fdopen(r_err, "rb"))
        try:
            with self._lock:
                self._execs[ex.rid] = ex
                msg = marshal.dumps({"id": ex.rid, "argv": argv, "env": env, "cwd": cwd}, 4)
                socket.send_fds(self.sock, [msg], [r_in, w_out, w_err])
        except OSError as e:
            self._execs.pop(ex.rid, None)
            raise LauncherError(f"the session's exec server is gone: {e}") from None
        finally:
            for fd in (r_in, w_out, w_err):
                os.close(fd)
        if not ex.started.wait(START_TIMEOUT_S):
            self.kill(ex.rid)
            raise LauncherError("the session's exec server did not start the command")
        return ex

    def kill(self, rid: int) -> None:
        with self._lock, contextlib.suppress(OSError):
            self.sock.send(marshal.dumps({"kill": rid}, 4))

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(4096)
            except OSError:
                msg = b""
            if not msg:
                break
            kind, rid, value = marshal.loads(msg)  # noqa: S302 - our own server's
            ex = self._execs.get(rid)
            if ex is None:
                continue
            if kind == "started":
                ex.pid = value
                ex.started.set()
            else:
                self._execs.pop(rid, None)
                ex._end(value)
        # the server is gone (the sandbox was killed): every exec of it ended with it
        for ex in list(self._execs.values()):
            ex._end(137)
        self._execs.clear()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
