"""The guest agent's children forked ahead (`guest_agent.hand`, `receive`, `Agent.spawn`) on
real pipes: a message arrives whole whatever its size, a child that is gone is told apart
(and a fresh one forked), a child that is not needed leaves quietly."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.launcher import vmchannel

messages = st.dictionaries(st.text(max_size=8), st.one_of(
    st.text(max_size=50), st.binary(max_size=200_000), st.lists(st.text(max_size=20))),
    max_size=5)


@pytest.fixture(scope="module")
def agent() -> ModuleType:
    # in the guest, vmchannel is a top-level module loaded from the plan
    sys.modules.setdefault("vmchannel", vmchannel)
    return importlib.import_module("stockade.launcher.guest_agent")


def _received(agent: ModuleType, message: dict[str, Any]) -> tuple[bool, Any]:
    r, w = os.pipe()
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(agent.receive(r)))
    reader.start()  # a message past the pipe's buffer needs its reader running
    ok = agent.hand(w, message)
    reader.join(10)
    os.close(r)
    return ok, got[0]


@settings(max_examples=25, deadline=None)
@given(messages)
def test_a_message_arrives_whole(agent: ModuleType, message: dict[str, Any]) -> None:
    assert _received(agent, message) == (True, message)


def test_hand_to_a_child_that_is_gone_is_false_and_closes(agent: ModuleType) -> None:
    r, w = os.pipe()
    os.close(r)
    assert agent.hand(w, {"argv": ["true"]}) is False
    with pytest.raises(OSError):
        os.fstat(w)  # closed either way


def _exit_status(fn: Any) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(3)  # receive returned or raised: not the quiet leave
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_child_not_needed_leaves_quietly_a_cut_message_is_an_error(
        agent: ModuleType) -> None:
    r, w = os.pipe()
    os.close(w)
    assert _exit_status(lambda: agent.receive(r)) == 0
    os.close(r)
    r, w = os.pipe()
    os.write(w, (100).to_bytes(4, "big") + b"short")
    os.close(w)
    with pytest.raises(OSError, match="inside a message"):
        agent.receive(r)
    os.close(r)


class Forks:
    """The agent's `fork`: pipes standing in for a child (its request end kept, or closed
    when `dead`), the requests each got."""

    def __init__(self) -> None:
        self.children: list[tuple[int, int, list[int]]] = []  # (pid, request end, stdio)

    def __call__(self, dead: bool = False) -> tuple[int, int, tuple[int, ...]]:
        r, w = os.pipe()
        if dead:
            os.close(r)
        stdio = [os.pipe() for _ in range(3)]
        for far, _ in stdio:
            os.set_blocking(far, False)
        pid = 1000 + len(self.children)
        self.children.append((pid, r, [far for far, _ in stdio]))
        return pid, w, tuple(near for _, near in stdio)

    def request(self, i: int, agent: ModuleType) -> Any:
        return agent.receive(self.children[i][1])

    def closed(self, i: int) -> bool:
        """Whether the agent closed child `i`'s stdio ends (their far ends see EOF)."""
        out = []
        for far in self.children[i][2]:
            try:
                out.append(os.read(far, 1) == b"")
            except BlockingIOError:
                out.append(False)
        return all(out)


def test_spawn_uses_the_child_forked_ahead_once_then_forks_afresh(agent: ModuleType) -> None:
    forks = Forks()
    a = object.__new__(agent.Agent)
    admitted: list[int] = []
    a.fork, a.warm, a.admit = forks, forks(), admitted.append
    req = {"argv": ["true"], "env": {"PATH": "/usr/bin"}, "cwd": "/scratch", "stdin": False}
    pid, *_ = a.spawn(req)
    assert pid == 1000 and a.warm is None and len(forks.children) == 1
    assert forks.request(0, agent) == {"argv": ["true"], "env": {"PATH": "/usr/bin"},
                                       "cwd": "/scratch"}
    pid2, *_ = a.spawn(dict(req, argv=["id"]))  # none ahead: a fresh child
    assert pid2 == 1001 and forks.request(1, agent)["argv"] == ["id"]
    assert not forks.closed(0)  # the exec's stdio: the agent's to pump
    assert admitted == [1000, 1001]  # each moved into the task's cgroup before its request


def test_a_child_that_cannot_join_the_cgroup_is_told_to_fail(agent: ModuleType) -> None:
    """At the task's pids limit the move into its cgroup fails: the child is not handed
    the command (it would run outside the cgroup) but the reason it fails with."""
    forks = Forks()
    a = object.__new__(agent.Agent)

    def full(pid: int) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    a.fork, a.warm, a.admit = forks, forks(), full
    a.spawn({"argv": ["sh", "-c", "x"], "env": {"A": "b"}, "cwd": "/scratch"})
    assert forks.request(0, agent) == {
        "argv": ["sh", "-c", "x"],
        "fail": "cannot join the task's cgroup: Resource temporarily unavailable"}


def test_a_child_ahead_that_is_gone_is_replaced_and_its_pipes_closed(
        agent: ModuleType) -> None:
    forks = Forks()
    a = object.__new__(agent.Agent)
    a.fork, a.warm, a.admit = forks, forks(dead=True), lambda pid: None  # killed, say
    pid, *_ = a.spawn({"argv": ["true"], "env": {}, "cwd": "/scratch"})
    assert pid == 1001 and forks.request(1, agent)["argv"] == ["true"]
    assert forks.closed(0) and not forks.closed(1)


def test_drop_warm_ends_the_child_forked_ahead(agent: ModuleType) -> None:
    forks = Forks()
    a = object.__new__(agent.Agent)
    a.fork, a.warm = forks, forks()
    a.drop_warm()
    assert a.warm is None and forks.closed(0)
    r = forks.children[0][1]
    assert _exit_status(lambda: agent.receive(r)) == 0  # the child's quiet leave
    a.drop_warm()  # nothing ahead: nothing to do
