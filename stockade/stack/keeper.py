"""The keeper of a shared embedded stack: `python -m stockade.stack.keeper REQUEST.yaml`.

Started detached by the first `stockade run` on a run_dir (stack.embedded); it owns the
gateway, broker and dev OpenBao, publishes `stack.json` once they answer, and stops them
when no run holds a lease any more (checked under the stack lock, so no run can join a
stack that is being stopped), or on SIGTERM (the last run out). A component that dies is
restarted as under `stockade up` (stack.up.Supervisor); one that keeps dying ends it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from stockade.config import ConfigError, load_config
from stockade.events.writer import EventWriter
from stockade.readiness import say_ready

from .services import Stack, StackError
from .shared import StackState, clear_state, live_leases, stack_lock, write_state
from .up import Supervisor

log = logging.getLogger("stockade.stack.keeper")
POLL_S = 1.0


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class _Shutdown:
    """Stop the stack, then drop the request, then the state (the last: a run waiting
    for the state to vanish may start the next stack on the same files); once only."""

    def __init__(self, stack: Stack, run_dir: Path, request: Path) -> None:
        self.stack, self.run_dir, self.request = stack, run_dir, request
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.stack.stop()
        self.request.unlink(missing_ok=True)
        clear_state(self.run_dir, os.getpid())


def _watch(stack: Stack, run_dir: Path, shutdown: _Shutdown, sup: Supervisor) -> None:
    """Keep the components running (restarted like under `stockade up`); return with the
    stack stopped, under the lock, once no lease is left."""
    while True:
        time.sleep(POLL_S)
        try:
            sup.tick(time.monotonic())
        except StackError:
            with stack_lock(run_dir):
                shutdown()  # under the lock: no run joins a stack that is going away
            raise
        with stack_lock(run_dir):
            if not live_leases(run_dir):
                shutdown()
                return


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the starting run's terminal may close
    if len(argv) not in (1, 2) or (len(argv) == 2 and not argv[1].isdigit()):
        print("usage: python -m stockade.stack.keeper REQUEST.yaml [READY_FD]", file=sys.stderr)
        return 2
    request = Path(argv[0])
    ready_fd = int(argv[1]) if len(argv) == 2 else None
    try:
        cfg = load_config(request)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    run_dir = Path(cfg.run_dir)
    # gateway and broker forked from here once their modules are imported (stack/prefork.py)
    stack = Stack(cfg, launcher_service=False, fork=True)
    shutdown = _Shutdown(stack, run_dir, request)
    try:
        stack.start()
        assert stack.config_file is not None
        write_state(run_dir, StackState(
            owner_pid=os.getpid(), kind="shared", config_file=str(stack.config_file),
            request_file=str(request), dev_vault=stack.dev_vault is not None))
        log.info("embedded stack ready (pid %d)", os.getpid())
        say_ready(ready_fd)  # the starting run waits on it (EOF: the keeper ended first)
        events = EventWriter(cfg.events_file, max_bytes=cfg.events.max_bytes,
                             backups=cfg.events.backups, chain=cfg.events.chain_signer(),
                             encode=cfg.events.encoder())
        try:
            sup = Supervisor(stack, events.write, lambda text: log.warning("%s", text),
                             time.monotonic())
            _watch(stack, run_dir, shutdown, sup)
        finally:
            events.close()
        return 0
    except StackError as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        log.info("stopping the embedded stack")
        return 0
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
