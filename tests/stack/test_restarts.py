"""`stockade up`'s restart policy (pure) and its supervisor over real child processes:
exponential backoff, capped, reset after a stable run, give up after K fast failures;
each restart is one component_restarted event."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stockade.config import Config
from stockade.events import validate
from stockade.stack.restarts import RestartTracker
from stockade.stack.services import Service, StackError
from stockade.stack.settings import StackSettings
from stockade.stack.up import Supervisor

POLICY = StackSettings(restart_delay_s=0.5, restart_delay_max_s=4.0, stable_after_s=30.0,
                       max_fast_failures=5)


def test_backoff_doubles_up_to_the_cap_then_gives_up() -> None:
    t = RestartTracker(POLICY)
    delays = []
    now = 0.0
    for _ in range(6):
        t.started(now)
        now += 1.0  # each death comes fast
        delays.append(t.exited(now))
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, None]


def test_a_stable_run_starts_the_backoff_over() -> None:
    t = RestartTracker(POLICY)
    t.started(0.0)
    assert t.exited(1.0) == 0.5
    t.started(2.0)
    assert t.exited(3.0) == 1.0
    t.started(4.0)
    assert t.exited(4.0 + POLICY.stable_after_s) == 0.5  # it was healthy for a while


@given(st.lists(st.floats(min_value=0, max_value=100), min_size=1, max_size=40))
def test_delays_stay_within_bounds(uptimes: list[float]) -> None:
    t = RestartTracker(POLICY)
    now = 0.0
    for up in uptimes:
        t.started(now)
        now += up
        d = t.exited(now)
        if d is None:
            assert t.failures > POLICY.max_fast_failures
            return
        assert POLICY.restart_delay_s <= d <= POLICY.restart_delay_max_s


class _Stack:
    """What Supervisor uses of a Stack: its services, config and dev Vault."""

    def __init__(self, services: list[Service], policy: StackSettings) -> None:
        self.services = services
        self.config = Config(stack=policy)
        self.dev_vault = None


def _service(tmp_path: Path, name: str, code: str) -> Service:
    svc = Service(name, [sys.executable, "-c", code], str(tmp_path / f"{name}.sock"),
                  tmp_path / f"{name}.log")
    svc.start()
    return svc


def test_supervisor_restarts_a_dead_service_with_an_event(tmp_path: Path) -> None:
    dies = _service(tmp_path, "gateway", "import sys; sys.exit(3)")
    lives = _service(tmp_path, "broker", "import time; time.sleep(60)")
    events: list[dict] = []
    said: list[str] = []
    stack = _Stack([dies, lives], POLICY)
    sup = Supervisor(stack, events.append, said.append, now=0.0)  # type: ignore[arg-type]
    try:
        assert dies.proc is not None
        dies.proc.wait(timeout=30)
        first = dies.proc.pid
        sup.tick(1.0)  # noticed: scheduled after 0.5 s
        assert said == ["gateway exited (3); restarting in 0.5s"] and not events
        sup.tick(1.2)  # not yet
        assert dies.proc.pid == first
        sup.tick(1.6)
        assert dies.proc.pid != first and lives.alive()
        assert len(events) == 1
        ev = events[0]
        validate(ev)
        assert ev["event"]["action"] == "component_restarted"
        assert ev["stockade"]["service"] == "gateway" and ev["process"]["exit_code"] == 3
    finally:
        dies.stop()
        lives.stop()


def test_supervisor_gives_up_after_fast_failures(tmp_path: Path) -> None:
    policy = StackSettings(restart_delay_s=0.1, restart_delay_max_s=0.1, max_fast_failures=2)
    svc = _service(tmp_path, "broker", "print('cannot bind'); raise SystemExit(1)")
    sup = Supervisor(_Stack([svc], policy), [].append, [].append, now=0.0)  # type: ignore[arg-type]
    now = 0.0
    try:
        with pytest.raises(StackError, match=r"(?s)broker died 3 times in a row.*cannot bind"):
            for _ in range(200):
                assert svc.proc is not None
                svc.proc.wait(timeout=30)
                now += 1.0
                sup.tick(now)
    finally:
        svc.stop()
