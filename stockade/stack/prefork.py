"""Gateway and broker forked from the embedded stack's keeper, which imported their
modules once, instead of two interpreters that each import them.

Why: each exec'd component imported the same 0.4-0.5 s of CPU (aiohttp, pydantic and the
configuration's models, the rule model, the event chain's key); on 2 busy cores that was
the embedded `stockade run`'s wall time (bench/README.md, "The embedded run: one
interpreter's imports"). The keeper imports a component's modules (`preload`), then
forks it (`fork_service`). The child is set up as the exec'd `setpriv --pdeathsig TERM --
python -m stockade NAME serve ...` was: a session of its own, SIGTERM when the keeper's
thread ends, stdin /dev/null, stdout and stderr to its log, no other descriptor of the
keeper, the keeper's signal handlers and logging undone; then it runs the same command
line through `stockade.cli.main` and exits with its code. Both run as root, as the exec'd
ones did. Forking is only done from a keeper with no other thread (a fork copies no
thread, and a lock another thread held would stay held in the child): else the caller
execs as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from stockade.readiness import READY_FD_ENV

# what `stockade NAME serve` imports before it listens: its modules, and what their
# start-up imports where it is used (the rule model's build, uvloop, the chain key's
# OpenSSL backend, the DNS firewall); from PYTHONPROFILEIMPORTTIME=1 in the children's logs
_SHARED = ("stockade.serving", "stockade.policy.build", "uvloop",
           "cryptography.hazmat.backends.openssl.backend")
PRELOAD: dict[str, tuple[str, ...]] = {
    "gateway": ("stockade.gateway.cli", "stockade.gateway.service",
                "stockade.gateway.dns.firewall", *_SHARED),
    "broker": ("stockade.broker.cli", "stockade.broker.service", *_SHARED),
}
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
_RESET = {signal.SIGTERM, signal.SIGINT}  # the dispositions a child sets as its own


_holds_secrets = False  # a secret value or a Vault token is in this process's memory
# the children that may be forked all the same: the broker reads the Vault token and the
# secrets itself (vault.token_file, its Vault), so a copy of them gives it nothing new
TRUSTED = frozenset({"broker"})


def hold_secrets() -> None:
    """A secret value (a `--secret`, `dev_vault.secrets`) or the dev OpenBao's root token
    is now in this process's memory: a fork would copy it into the child, so from here on
    only a child trusted with them (the broker) is forked; the gateway, which faces the
    sandboxes' traffic, and a keeper that would fork one are exec'd as before."""
    global _holds_secrets
    _holds_secrets = True


def can_fork(*, trusted: bool = False) -> bool:
    """Only the calling thread runs (see the module's docstring), and no secret would be
    copied into a child that must not hold it (`hold_secrets`)."""
    return threading.active_count() == 1 and (trusted or not _holds_secrets)


def preload(name: str) -> None:
    for module in PRELOAD.get(name, ()):
        importlib.import_module(module)


class Forked:
    """A forked child, with what the stack uses of `subprocess.Popen`: `pid`, `poll`,
    `wait` (on a pidfd: no polling) and `returncode`."""

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid, self.args = pid, argv
        self.returncode: int | None = None

    def _reaped(self, flags: int) -> int | None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere: its code is lost
            self.returncode = -1
            return self.returncode
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode if self.returncode is not None else self._reaped(os.WNOHANG)

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is not None:
            return self.returncode  # type: ignore[return-value]
        fd = os.pidfd_open(self.pid)
        try:
            if not select.select([fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        finally:
            os.close(fd)
        code = self._reaped(0)
        assert code is not None
        return code


def fork_service(argv: list[str], log_fd: int | None, *, ready_fd: int | None = None,
                 main: Callable[[list[str]], int] | None = None) -> Forked:
    """`stockade ARGV...` in a forked child (see the module's docstring); `log_fd`: its
    stdout and stderr (None: the keeper's own); `ready_fd`: the write end of its ready
    pipe, the one descriptor it keeps (as 3, named by STOCKADE_READY_FD); `main`: what
    runs ARGV in the child (`stockade.cli.main`; tests pass a probe)."""

    def run() -> int:
        if main is not None:
            return main(argv)
        from stockade.cli import main as cli_main

        return cli_main(argv)

    return _fork(["stockade", *argv], run,
                 _Child(log_fd, ready_fd, READY_FD_ENV, True, f"stk-{argv[0]}"))


def fork_keeper(request: str, log_fd: int, ready_fd: int) -> Forked:
    """The embedded stack's keeper (`python -m stockade.stack.keeper REQUEST READY_FD`)
    forked from the starting run, which imported the configuration's models, the rules
    and the events already. Unlike a service it outlives its parent (no pdeathsig): it
    belongs to every run that joins its stack."""

    def run() -> int:
        from . import keeper  # in the child: the run goes on meanwhile

        return keeper.main([request, "3"])

    return _fork(["stockade.stack.keeper", request], run,
                 _Child(log_fd, ready_fd, None, False, "stk-keeper"))


@dataclass(frozen=True)
class _Child:
    log_fd: int | None  # stdout and stderr (None: the parent's)
    ready_fd: int | None  # kept as 3
    ready_env: str | None  # the variable that names it, if any
    dies_with_parent: bool  # SIGTERM when the forking thread ends
    # its name in ps -o comm, top, pgrep (its command line stays its parent's)
    name: str


def _fork(argv: list[str], run: Callable[[], int], child: _Child) -> Forked:
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # else the child writes the buffers again
        with contextlib.suppress(Exception):
            stream.flush()
    # blocked across the fork: one that came before the child's own dispositions would
    # run (or, the parent's Python handler gone, be dropped by) the parent's handler
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _RESET)
    pid = os.fork()
    if pid == 0:
        _in_child(argv, run, child, parent, mask)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return Forked(pid, argv)


def _in_child(argv: list[str], run: Callable[[], int], child: _Child,
              parent: int, mask: set[signal.Signals]) -> NoReturn:
    code = 1
    try:
        _detach(child, parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending SIGTERM ends it now
        sys.argv = list(argv)
        code = run()
    except SystemExit as e:  # argparse and the handlers end this way
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        # the parent's objects (its lock, its writer) are not this process's to finalise
        os._exit(code)


def _detach(child: _Child, parent: int) -> None:
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, child.name.encode()[:15], 0, 0, 0)
    if child.dies_with_parent:
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # it died before the prctl: nothing would stop us
            os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    if child.log_fd is not None:
        os.dup2(child.log_fd, 1)
        os.dup2(child.log_fd, 2)
    keep = 3
    if child.ready_env:
        os.environ.pop(child.ready_env, None)  # the parent's is not this child's
    if child.ready_fd is not None:
        os.dup2(child.ready_fd, keep)
        if child.ready_env:
            os.environ[child.ready_env] = str(keep)
        keep += 1
    os.closerange(keep, os.sysconf("SC_OPEN_MAX"))  # close_range(2): one call
    # the parent's may not be the descriptors 0-2 (a test runner captures them in memory)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # as a fresh interpreter has them (an ignored SIGHUP stays ignored, as across exec)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root = logging.getLogger()
    for handler in list(root.handlers):  # the keeper's: the command sets up its own
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
