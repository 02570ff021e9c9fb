"""The embedded stack's keeper forks gateway and broker (stockade/stack/prefork.py): each
child starts as the exec'd `setpriv --pdeathsig TERM -- python -m stockade ...` did (its
own session, stdin /dev/null, stdout and stderr to its log, no other descriptor of the
keeper, default SIGTERM and SIGINT, no logging handler of the keeper's), dies with the
keeper, and is waited for on a pidfd. Each parent here is a fresh interpreter of its own
(never the test process, whose threads a fork must not copy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from stockade.procs import pid_alive
from stockade.stack import prefork

PARENT = r"""
import io, json, logging, os, signal, sys, time
from stockade.stack import prefork

def probe(argv):
    fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
    print(json.dumps({
        "argv": argv, "sys_argv": sys.argv, "session_leader": os.getsid(0) == os.getpid(),
        "fds": fds, "stdin": os.readlink("/proc/self/fd/0"),
        "term_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "int_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "root_handlers": len(logging.getLogger().handlers),
        "parent": os.getppid(), "comm": open("/proc/self/comm").read().strip(),
    }), flush=True)
    if argv[0] == "sleep":
        time.sleep(120)
    return 7

logging.basicConfig(level=logging.INFO)  # the keeper's own, not the child's
signal.signal(signal.SIGTERM, lambda *a: None)
r, w = os.pipe()
os.dup2(w, 50)  # a descriptor of the keeper's the child must not hold
log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
real_stdout, sys.stdout = sys.stdout, io.StringIO()  # as a test runner's capture does
child = prefork.fork_service([sys.argv[2], "--config", "x"], log, main=probe)
sys.stdout = real_stdout
print(json.dumps({"child": child.pid, "keeper": os.getpid()}), flush=True)
if sys.argv[2] == "sleep" and sys.argv[3] == "early":
    os.kill(child.pid, signal.SIGTERM)  # likely before the child set its own handlers
elif sys.argv[2] == "sleep":
    try:
        child.wait(timeout=0.05)
    except Exception as e:
        print(json.dumps({"timeout": type(e).__name__}), flush=True)
    if sys.argv[3] == "die":
        os.kill(os.getpid(), signal.SIGKILL)  # the keeper SIGKILLed: no stop() runs
    os.kill(child.pid, signal.SIGTERM)
print(json.dumps({"code": child.wait(), "poll": child.poll()}), flush=True)
"""


def _parent(tmp_path: Path, *args: str) -> tuple[list[dict], dict]:
    log = tmp_path / "service.log"
    out = subprocess.run([sys.executable, "-c", PARENT, str(log), *args], capture_output=True,
                         text=True, timeout=120)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    child = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    return lines, (child[0] if child else {})


def test_a_forked_service_starts_as_an_execd_one(tmp_path: Path) -> None:
    lines, child = _parent(tmp_path, "run")
    assert lines[-1] == {"code": 7, "poll": 7}  # its exit code, reaped once
    assert child["argv"] == ["run", "--config", "x"]
    assert child["sys_argv"] == ["stockade", "run", "--config", "x"]
    assert child["session_leader"]
    assert child["stdin"] == "/dev/null"
    # 0-2 and the one listdir reads /proc/self/fd with: not the keeper's pipe (50), nor
    # its log's descriptor
    assert set(child["fds"]) <= {0, 1, 2, 3} and 50 not in child["fds"]
    assert child["comm"] == "stk-run"
    assert child["term_default"] and child["int_default"]
    assert child["root_handlers"] == 0
    assert child["parent"] == lines[0]["keeper"]


def test_a_forked_service_is_waited_for_and_stopped(tmp_path: Path) -> None:
    lines, _ = _parent(tmp_path, "sleep", "stop")
    assert {"timeout": "TimeoutExpired"} in lines
    assert lines[-1] == {"code": -15, "poll": -15}


def test_a_sigterm_right_after_the_fork_ends_the_child(tmp_path: Path) -> None:
    """Signals stay blocked from the fork until the child has its own dispositions: a
    SIGTERM in between is neither run by the parent's (Python) handler nor dropped."""
    for _ in range(5):
        lines, _ = _parent(tmp_path, "sleep", "early")
        assert lines[-1] == {"code": -15, "poll": -15}


def test_a_forked_service_dies_with_its_keeper(tmp_path: Path) -> None:
    """The keeper SIGKILLed: the child gets SIGTERM (PR_SET_PDEATHSIG), as setpriv's
    --pdeathsig gave the exec'd one."""
    lines, child = _parent(tmp_path, "sleep", "die")
    pid = lines[0]["child"]
    assert child["argv"][0] == "sleep"
    deadline = time.monotonic() + 60
    while not _ended(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(pid)


def _ended(pid: int) -> bool:
    """Gone, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not pid_alive(pid)
    return stat[stat.rfind(")") + 2:].split()[0] in ("Z", "X")


CAN_FORK = r"""
import threading
from stockade.stack import prefork
alone = prefork.can_fork()
stop = threading.Event()
th = threading.Thread(target=stop.wait)
th.start()
with_thread = prefork.can_fork()
stop.set()
th.join()
prefork.hold_secrets()
print(alone, with_thread, prefork.can_fork(), prefork.can_fork(trusted=True))
"""


def test_a_keeper_with_another_thread_or_a_secret_does_not_fork() -> None:
    """A fresh interpreter (the test process runs other tests' threads): it forks alone;
    not with another thread (a lock it held would stay held in the child); once it holds
    a secret, only a trusted child (the broker) is forked."""
    out = subprocess.run([sys.executable, "-c", CAN_FORK], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["True", "False", "False", "True"]
    assert "broker" in prefork.TRUSTED and "gateway" not in prefork.TRUSTED


def test_the_preloaded_modules_are_what_the_services_import() -> None:
    """Every module named exists (a rename would make the keeper's preload fail)."""
    code = ("from stockade.stack import prefork\n"
            "for name in prefork.PRELOAD: prefork.preload(name)\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert out.stdout.strip() == "ok"


KEEPER_PARENT = r"""
import json, os, sys, time
from stockade.stack import keeper, prefork

def probe(argv):
    time.sleep(1.0)  # its parent (the run) has exited by then
    print(json.dumps({
        "ready": os.readlink(f"/proc/self/fd/{argv[1]}").startswith("pipe:"),
        "argv": argv, "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
        "session_leader": os.getsid(0) == os.getpid(), "parent_gone": os.getppid() != PARENT,
        "comm": open("/proc/self/comm").read().strip(),
    }), flush=True)
    return 0

keeper.main = probe
PARENT = os.getpid()
r, w = os.pipe()
os.dup2(r, 50)  # the run's own descriptors (its stack lock): not the keeper's
log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
child = prefork.fork_keeper("/x/stack-request.yaml", log, w)
os.close(w)
print(json.dumps({"child": child.pid}), flush=True)
"""


def test_the_keeper_forked_from_a_run_outlives_it(tmp_path: Path) -> None:
    """The run exits right after the fork; the keeper goes on in its own session with
    its log and its ready pipe (as fd 3, its argument) and nothing else of the run's."""
    log = tmp_path / "stack.log"
    out = subprocess.run([sys.executable, "-c", KEEPER_PARENT, str(log)], capture_output=True,
                         text=True, timeout=60, check=True)
    pid = json.loads(out.stdout)["child"]
    deadline = time.monotonic() + 60
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = json.loads(log.read_text().splitlines()[0])
    assert child["argv"] == ["/x/stack-request.yaml", "3"]
    assert child["parent_gone"] and child["session_leader"]
    assert set(child["fds"]) <= {0, 1, 2, 3, 4} and 50 not in child["fds"]
    assert child["comm"] == "stk-keeper" and child["ready"]
    while not _ended(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(pid)  # its probe returned: the child _exits with the code


HOLDER = r"""
import os, sys, time
from stockade.stack import prefork
from stockade.stack.services import Service
secret = "sk-" + os.urandom(16).hex()  # a secret value in this process's memory
prefork.hold_secrets()
svc = Service("gateway", ["sleep", "60"], "/nonexistent.sock", None, fork_argv=["gateway"])
svc.start()
print(svc.proc.pid, open(f"/proc/{svc.proc.pid}/comm").read().strip(), flush=True)
svc.proc.terminate()
svc.proc.wait()
"""


def test_a_gateway_started_after_a_secret_is_execd_not_forked() -> None:
    out = subprocess.run([sys.executable, "-c", HOLDER], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out[1] == "sleep"  # exec'd argv, not a forked copy (`stk-gateway`) of the holder
