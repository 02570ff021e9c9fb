"""`stockade up`: the stack in the foreground, its components kept running.

A component that dies is restarted with backoff (stack.restarts) and a
`component_restarted` event, instead of the whole stack stopping with it: stopping took
the dev OpenBao's in-memory secrets along. Meanwhile the fence stays closed: the
launcher's nft rules keep redirecting sandbox traffic to the dead gateway's ports, where
nothing answers (a refused connection, never a direct one). The dev OpenBao itself is not
restarted: a new one would hold none of the secrets, so its death ends `up`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from stockade.config import Config
from stockade.events.build import make_event
from stockade.events.chainkey import ChainError
from stockade.events.writer import EventWriter

from .devsecrets import SecretValue
from .embedded import current_state, write_request
from .restarts import RestartTracker
from .services import Service, Stack, StackError, put_dev_secrets, stack_running
from .shared import StackState, clear_state, stack_lock, write_state

POLL_S = 0.5


class Supervisor:
    """Restarts dead services of a started Stack; `tick(now)` raises StackError on giving up."""

    def __init__(self, stack: Stack, emit: Callable[[dict[str, object]], None],
                 say: Callable[[str], None], now: float) -> None:
        self.stack = stack
        self.emit = emit
        self.say = say
        self.trackers = {s.name: RestartTracker(stack.config.stack) for s in stack.services}
        for t in self.trackers.values():
            t.started(now)
        self.due: dict[str, tuple[float, float, int | None]] = {}  # name -> (at, delay, rc)
        self.restarts: dict[str, int] = {}

    def tick(self, now: float) -> None:
        bao = self.stack.dev_vault
        if bao is not None and not getattr(bao, "running", True):
            raise StackError("the dev OpenBao exited (its in-memory secrets are gone); stopping")
        for svc in self.stack.services:
            if svc.alive():
                continue
            if svc.name not in self.due:
                self._schedule(svc, now)
            elif now >= self.due[svc.name][0]:
                self._restart(svc, now)

    def _schedule(self, svc: Service, now: float) -> None:
        code = svc.proc.returncode if svc.proc is not None else None
        delay = self.trackers[svc.name].exited(now)
        if delay is None:
            p = self.stack.config.stack
            raise StackError(
                f"{svc.name} died {p.max_fast_failures + 1} times in a row, each within "
                f"{p.stable_after_s:.0f}s of its start (last exit {code}); giving up"
                + (f":\n{svc.log_tail()}" if svc.log_path else "")
            )
        self.due[svc.name] = (now + delay, delay, code)
        self.say(f"{svc.name} exited ({code}); restarting in {delay:.1f}s")

    def _restart(self, svc: Service, now: float) -> None:
        _, delay, code = self.due.pop(svc.name)
        svc.restart()
        self.trackers[svc.name].started(now)
        n = self.restarts[svc.name] = self.restarts.get(svc.name, 0) + 1
        self.say(f"{svc.name:<14} pid {svc.proc.pid if svc.proc else None}  restarted")
        self.emit(make_event(
            component="stack", action="component_restarted", reason="component_exited",
            message=f"{svc.name} exited ({code}) and was restarted after {delay:.1f}s",
            extra={"service": svc.name, "exit_code": code, "restarts": n, "delay_s": delay},
        ))


def _say(text: str) -> None:
    print(f"stockade up: {text}", file=sys.stderr, flush=True)


def _start(cfg: Config, secrets: Sequence[SecretValue]) -> Stack:
    """Start the stack under the run_dir's lock (no `stockade run` starts one meanwhile)
    and record it in stack.json, so runs find it and its dev OpenBao."""
    run_dir = Path(cfg.run_dir)
    with stack_lock(run_dir):
        if current_state(run_dir) is not None or stack_running(cfg):
            raise StackError("a stack is already running on these control sockets")
        stack = Stack(cfg, foreground=True)
        eff = stack.start()
        try:
            if secrets:
                put_dev_secrets(eff, stack.dev_vault is not None, secrets)
            assert stack.config_file is not None
            request = write_request(cfg, run_dir)
            stack.own_file(request)
            write_state(run_dir, StackState(
                owner_pid=os.getpid(), kind="up", config_file=str(stack.config_file),
                request_file=str(request), dev_vault=stack.dev_vault is not None))
        except BaseException:
            stack.stop()
            raise
    return stack


def _print_ready(stack: Stack) -> None:
    eff = stack.config
    for name, pid, state in stack.status():
        _say(f"{name:<14} pid {pid}  {state}")
    if stack.dev_vault is not None:
        _say(f"dev OpenBao at {eff.vault.address}; root token in {eff.vault.token_file} "
             "(put API keys there, or give them with --secret)")
    _say(f"sandbox API on {eff.launcher.control_socket} "
         "(stockade.launcher.service.LauncherClient)")
    _say("ready (Ctrl-C stops everything)")


def run_up(cfg: Config, secrets: Sequence[SecretValue] = ()) -> int:
    """Until Ctrl-C/SIGTERM (0) or a component that cannot be kept up (1)."""
    try:
        chain = cfg.events.chain_signer()  # an unusable key stops `up` before anything starts
        stack = _start(cfg, secrets)
    except (StackError, ChainError) as e:
        _say(str(e))
        return 1
    events = EventWriter(cfg.events_file, max_bytes=cfg.events.max_bytes,
                         backups=cfg.events.backups, chain=chain,
                         encode=cfg.events.encoder())
    try:
        _print_ready(stack)
        sup = Supervisor(stack, events.write, _say, time.monotonic())
        while True:
            time.sleep(POLL_S)
            sup.tick(time.monotonic())
    except StackError as e:
        _say(str(e))
        return 1
    except KeyboardInterrupt:
        print("\nstockade up: stopping", file=sys.stderr)
        return 0
    finally:
        with stack_lock(Path(cfg.run_dir)):
            stack.stop()
            clear_state(Path(cfg.run_dir), os.getpid())
        events.close()
