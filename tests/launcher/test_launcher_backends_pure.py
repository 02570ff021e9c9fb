"""The backend interface and the pure end rules the launcher's facade relies on."""

import inspect
import signal

import pytest
from stockade.launcher.backends import NAMES, Backend, backend_for
from stockade.launcher.spec import LauncherError
from stockade.launcher.supervise import classify_end, exit_status

SIGKILLED = 128 + signal.SIGKILL


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_implements_the_protocol(name: str) -> None:
    backend = backend_for(name)
    assert backend.name == name
    for method in ("create", "start", "wait", "kill", "suspend", "resume", "teardown",
                   "configure", "discard", "sweep"):
        want = inspect.signature(getattr(Backend, method))
        got = inspect.signature(getattr(type(backend), method))
        assert list(got.parameters) == list(want.parameters), method


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(LauncherError, match="no firecracker backend"):
        backend_for("firecracker")


@pytest.mark.parametrize(("ended_by", "code", "killed", "limit", "want"), [
    ("exit", 0, False, False, ("exit", 0)),
    ("exit", 3, False, False, ("exit", 3)),
    ("exit", 1, False, True, ("limit", 1)),  # OOM, pids or a full scratch
    ("exit", 1, True, False, ("killed", SIGKILLED)),  # a kill from another process
    ("ttl", 1, False, False, ("ttl", SIGKILLED)),  # unshare's exit 1 is not the story
    ("limit", 1, False, False, ("limit", SIGKILLED)),
    ("ttl", 1, True, False, ("killed", SIGKILLED)),
])
def test_classify_end(ended_by: str, code: int, killed: bool, limit: bool,
                      want: tuple[str, int]) -> None:
    assert classify_end(ended_by, code, killed, lambda: limit) == want  # type: ignore[arg-type]


def test_limit_is_asked_only_for_a_plain_exit() -> None:
    def boom() -> bool:
        raise AssertionError("asked")

    assert classify_end("ttl", 0, False, boom) == ("ttl", SIGKILLED)
    assert classify_end("exit", 0, True, boom) == ("killed", SIGKILLED)


def test_exit_status_of_a_signal() -> None:
    assert exit_status(-9) == SIGKILLED and exit_status(2) == 2
