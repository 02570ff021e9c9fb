"""A stack's child dies with its owner even when the owner is SIGKILLed (never runs stop()):
an orphaned gateway would keep the ports and sockets the next stack needs. The stack
waits for its children on their ready pipes (stockade/readiness.py), not by polling."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from polling import eventually

from stockade.config import Config
from stockade.stack.services import Service, Stack, StackError
from stockade.stack.shared import owner_alive

OWNER = """
import sys, time
from stockade.stack.services import Service
svc = Service("gateway", ["sleep", "300"], "/nonexistent.sock", None)
svc.start()
print(svc.proc.pid, flush=True)
time.sleep(300)
"""


def test_a_service_dies_with_its_sigkilled_owner() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        assert owner_alive(child)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        eventually(lambda: not owner_alive(child), 30)
        assert not owner_alive(child), "the service outlived its owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if child and owner_alive(child):
            os.kill(child, signal.SIGKILL)


def test_start_returns_once_the_death_guard_holds() -> None:
    """setpriv sets PDEATHSIG and then execs the program: a start that returned before
    would leave a window in which a SIGKILLed owner orphans its child for good."""
    svc = Service("gateway", ["sleep", "300"], Path("/nonexistent.sock"), None)
    svc.start()
    try:
        assert svc.proc is not None
        assert os.readlink(f"/proc/{svc.proc.pid}/exe") == os.path.realpath(
            shutil.which("sleep") or "sleep")
    finally:
        svc.stop(timeout=1.0)


# a service that serves /v1/health on its control socket once it says it is ready, and
# counts the health requests it answered (in SOCK.count)
READY_SERVICE = r"""
import http.server, json, os, socketserver, sys
from stockade.readiness import say_ready, take_ready_fd
sock, mode = sys.argv[1], sys.argv[2]
fd = take_ready_fd()
if mode == "dies":
    sys.exit(3)
seen = 0
class H(http.server.BaseHTTPRequestHandler):
    def address_string(self): return "unix"
    def log_message(self, *a): pass
    def do_GET(self):
        global seen
        seen += 1
        open(sock + ".count", "w").write(str(seen))
        body = json.dumps({"ok": True}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
srv = socketserver.UnixStreamServer(sock, H)
say_ready(fd)
srv.serve_forever()
"""


def _ready_service(tmp_path: Path, mode: str) -> Service:
    sock = tmp_path / f"{mode}.sock"
    return Service(mode, [sys.executable, "-c", READY_SERVICE, str(sock), mode], str(sock),
                   tmp_path / f"{mode}.log")


def test_the_stack_waits_on_the_ready_pipe_not_on_polls(tmp_path: Path) -> None:
    """The service is asked for its health once, after its ready byte: never polled."""
    stack = Stack(Config(run_dir=str(tmp_path)), launcher_service=False)
    svc = _ready_service(tmp_path, "serves")
    svc.start()
    try:
        stack._wait_ready([svc], time.monotonic() + 60)
        assert Path(svc.control_socket + ".count").read_text() == "1"
        assert svc.ready_fd is None  # read and closed
    finally:
        svc.stop()


def test_a_service_that_ends_before_it_is_ready_is_reported(tmp_path: Path) -> None:
    stack = Stack(Config(run_dir=str(tmp_path)), launcher_service=False)
    svc = _ready_service(tmp_path, "dies")
    svc.start()
    try:
        with pytest.raises(StackError, match="dies exited during start-up"):
            stack._wait_ready([svc], time.monotonic() + 60)
    finally:
        svc.stop()
