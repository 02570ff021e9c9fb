"""The run's side of the shared embedded stack (protocol: stack.shared): join the
run_dir's stack or start its keeper, hold a lease, and stop the stack when last out."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from stockade.config import Config, ConfigError, load_config
from stockade.procs import ChildProcess

from . import prefork
from .services import StackError, stack_running
from .shared import (
    STATE_FILE,
    Lease,
    StackState,
    live_leases,
    owner_alive,
    read_state,
    stack_lock,
    stop_owner,
    write_private,
)

REQUEST_FILE = "stack-request.yaml"
KEEPER_LOG = "stack.log"


@dataclass
class Joined:
    config: Config  # the effective config (dev Vault address filled in)
    run_dir: Path
    state: StackState | None  # None: a stack this protocol does not know (used as it is)
    lease: Lease | None


def current_state(run_dir: Path) -> StackState | None:
    """The live owner's state; a dead owner's file is removed."""
    try:
        state = read_state(run_dir)
    except OSError as e:
        raise StackError(str(e)) from None
    if state is not None and not owner_alive(state.owner_pid):
        (run_dir / STATE_FILE).unlink(missing_ok=True)
        return None
    return state


def join(config: Config, *, start_timeout: float = 180.0,
         while_starting: Callable[[], None] | None = None, fork: bool = False) -> Joined:
    """`while_starting`: work of the caller's done while a keeper started here boots;
    `fork`: a keeper started here may be forked from this process (`stockade run`, whose
    memory holds nothing but its own work), not exec'd: any other caller's state would be
    copied into it and into the gateway it forks."""
    run_dir = Path(config.run_dir)
    with stack_lock(run_dir):
        state = current_state(run_dir)
        if state is None:
            if stack_running(config):
                return Joined(config, run_dir, None, None)  # started by other means
            state = _spawn_keeper(config, run_dir, start_timeout, while_starting, fork)
        else:
            _check_same_config(config, state)
        try:
            effective = load_config(state.config_file)
        except ConfigError as e:
            raise StackError(f"the running stack's config: {e}") from None
        lease = Lease(run_dir) if state.kind == "shared" else None
        return Joined(effective, run_dir, state, lease)


def leave(joined: Joined, *, stop_timeout: float = 90.0) -> None:
    """Drop the lease; the last one out stops a shared stack and waits until it is gone."""
    if joined.lease is None:
        return
    with stack_lock(joined.run_dir):
        joined.lease.release()
        if live_leases(joined.run_dir):
            return
        state = current_state(joined.run_dir)
        if state is None or state.kind != "shared":
            return
        if not stop_owner(joined.run_dir, state, stop_timeout):
            print(f"stockade: the embedded stack (pid {state.owner_pid}) did not stop in "
                  f"{stop_timeout:.0f}s", file=sys.stderr)


def _check_same_config(config: Config, state: StackState) -> None:
    try:
        theirs = load_config(state.request_file)
    except ConfigError as e:
        raise StackError(f"the running stack's config: {e}") from None
    if theirs != config:
        raise StackError(
            f"a stack with another configuration already runs on run_dir {config.run_dir} "
            f"(pid {state.owner_pid}); use the same configuration or another run_dir"
        )


def write_request(config: Config, run_dir: Path) -> Path:
    """The config a stack owner was started with, for joiners to compare theirs against."""
    dump = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    return write_private(run_dir / REQUEST_FILE, dump)


def _spawn_keeper(config: Config, run_dir: Path, timeout: float,
                  while_starting: Callable[[], None] | None, fork: bool) -> StackState:
    """Start the keeper (under the lock) and wait until its stack is ready: the keeper
    writes one byte on a pipe then (no polling); EOF first means it ended. In between,
    `while_starting` (its time overlaps the keeper's; its errors end the start)."""
    request = write_request(config, run_dir)
    log_path = Path(config.log_dir) / KEEPER_LOG
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = log_path.stat().st_size if log_path.exists() else 0
    ready_r, ready_w = os.pipe()
    try:
        with open(log_path, "ab") as log:
            proc: ChildProcess
            if fork and prefork.can_fork():  # this run's imports are most of the keeper's
                proc = prefork.fork_keeper(str(request), log.fileno(), ready_w)
            else:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "stockade.stack.keeper", str(request), str(ready_w)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    pass_fds=(ready_w,),
                    start_new_session=True,  # outlives this run; a Ctrl-C does not reach it
                )
        os.close(ready_w)  # only the keeper holds the write end: its exit is our EOF
        ready_w = -1
        if while_starting is not None:
            try:
                while_starting()
            except BaseException:
                _end_keeper(proc)
                raise
        said = _read_ready(ready_r, timeout)
    finally:
        os.close(ready_r)
        if ready_w >= 0:
            os.close(ready_w)
    state = current_state(run_dir) if said else None
    if state is not None and state.owner_pid == proc.pid:
        return state
    _end_keeper(proc)
    with open(log_path, "rb") as fh:
        fh.seek(start)
        tail = fh.read().decode(errors="replace")[-2000:]
    raise StackError(f"the embedded stack did not start:\n{tail}")


def _end_keeper(proc: ChildProcess) -> None:
    if proc.poll() is None:
        proc.terminate()  # the keeper stops what it started
        proc.wait(timeout=60)


def _read_ready(fd: int, timeout: float) -> bool:
    """True when the ready byte came within `timeout`; False on EOF or the timeout."""
    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable) and os.read(fd, 1) == b"R"
