"""The gateway's side of L7 inspection: runs the inspector child and hands flows to it.

`InspectorSupervisor` starts `stockade gateway inspector` (see `child.py`), writes
its spec (with a fresh hand-off signing key) on the child's stdin, waits for its
`{"ready": PORT}` line, and restarts it with a growing delay whenever it exits. While it
is not ready, `ready` is False and `why` says why; the gateway then denies flows that
need inspection `inspection_unavailable` (fail closed), with `why` in the event.

`end_task` tells the child a task was deregistered: one line on its stdin
(`control.py`), written without waiting, dropped when the child is down or not reading.

`handoff` opens the loopback connection for one flow: `CONNECT <checked-ip>:<port>`
with the signed metadata header, then waits for the inspector's `200`. Everything it
does is bounded by `handoff_timeout_s`. The child never runs on the gateway's event
loop; the gateway only waits on sockets and a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import secrets
import signal
import socket
import sys
from typing import Any

from stockade.trust import ca_dir, ensure_ca

from ..configview import GatewayConfig
from ..relay import wait_fd
from ..settings import InspectionSettings
from .control import end_task_line
from .handoff import FlowMeta, connect_request, health_request

log = logging.getLogger("stockade.gateway.inspector")

MAX_ANSWER = 4096  # the inspector's answer to the hand-off CONNECT is a short head
MAX_CONTROL_BACKLOG = 2**20  # control bytes queued for a child that does not read them


class InspectorUnavailable(Exception):
    pass


class InspectorSupervisor:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.settings: InspectionSettings = config.gateway.inspection
        self.ca_dir = ca_dir(config.state_dir, self.settings.ca_dir)
        self.ca_cert: str | None = None
        self.port: int | None = None
        self.key = b""
        self.proc: asyncio.subprocess.Process | None = None
        self.why = "the inspector has not started yet"
        self.starts = 0
        self.handoffs = 0  # flows handed over (metrics, tests)
        self.attempts = 0  # hand-offs begun, whether or not the inspector took them
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.hung = 0  # children killed because they stopped answering the health probe
        self.probes_ok = 0  # health probes answered (tests)
        self.delay = 0.0  # the last restart delay (tests, health)
        self.control_dropped = 0  # control lines not sent: the child's stdin was full

    @property
    def ready(self) -> bool:
        return self.port is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self) -> None:
        # the CA is made once (RSA key generation: off the loop) and reused afterwards
        try:
            self.ca_cert = str(await asyncio.to_thread(ensure_ca, self.ca_dir))
        except OSError as e:
            # the gateway serves on; flows that need inspection are denied with this reason
            self.why = f"the inspection CA could not be created in {self.ca_dir}: {e.strerror}"
            log.error("inspector: %s", self.why)
            return
        self._task = asyncio.ensure_future(self._supervise())

    async def stop(self) -> None:
        self._stopping = True
        self.port = None
        self.why = "the gateway is stopping"
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._terminate()

    async def _terminate(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    def _spec(self) -> dict[str, Any]:
        s = self.settings
        ev = self.config.events
        return {
            "key": self.key.hex(),
            "rules_dir": str(self.config.rules_dir),
            "events_file": str(self.config.events_file),
            "events": ev.model_dump(),
            "task_dir": str(self.config.task_events_dir),
            "ca_dir": str(self.ca_dir),
            "listen": s.listen,
            "upstream_ca_file": s.upstream_ca_file,
            "system_ca_dir": s.system_ca_dir,
            "upstream_first": s.upstream_first,
            # the gateway's loop choice (gateway.uvloop): uvloop's C transports take a
            # tenth off the inspector's CPU per request (bench/README.md "Inspected path")
            "uvloop": self.config.gateway.uvloop,
            "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        }

    async def _supervise(self) -> None:
        delay = 0.0
        while not self._stopping:
            uptime = 0.0
            try:
                uptime = await self._run_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failure to spawn: retry later
                log.exception("inspector: could not be started")
                self.why = f"the inspector could not be started ({type(e).__name__})"
            self.port = None
            if self._stopping:
                return
            delay = next_delay(delay, uptime, self.settings)
            self.delay = delay
            await asyncio.sleep(delay)

    async def _run_once(self) -> float:
        """Start one child and wait until it exits (or is killed as hung); the seconds it
        was ready (0: it never became ready)."""
        proc = await self._spawn()
        port = await self._wait_ready(proc)
        if port is None:
            return 0.0
        loop = asyncio.get_running_loop()
        ready_at = loop.time()
        self.port = port
        self.why = ""
        log.info("inspector: ready on port %s (pid %s)", port, proc.pid)
        code = await self._watch(proc, port)
        self.port = None
        if self.why == "":
            self.why = f"the inspector exited (code {code}) and is being restarted"
            log.warning("inspector: exited with code %s; restarting", code)
        self.proc = None
        return loop.time() - ready_at

    async def _spawn(self) -> asyncio.subprocess.Process:
        """A new child with its spec (and a fresh signing key) written on its stdin."""
        self.key = secrets.token_bytes(32)
        self.starts += 1
        self.proc = proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "stockade",
            "gateway",
            "inspector",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=None,  # the gateway's own stderr (journald)
            start_new_session=True,  # a Ctrl-C to the gateway's terminal is the gateway's
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(self._spec()).encode() + b"\n")
        await proc.stdin.drain()  # stdin stays open: its EOF tells the child to exit
        return proc

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> int | None:
        """The port from the child's `{"ready": PORT}` line; None (and the child
        terminated) when it does not come within start_timeout_s."""
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), self.settings.start_timeout_s)
            return int(json.loads(line)["ready"])
        except (TimeoutError, ValueError, KeyError, TypeError):
            self.why = "the inspector did not become ready"
            log.warning("inspector: not ready after start (exit code %s)", proc.returncode)
            await self._terminate()
            return None

    async def _watch(self, proc: asyncio.subprocess.Process, port: int) -> int:
        """Probe the ready child every health_interval_s until it exits, or kill it after
        health_failures missed probes in a row; its exit code."""
        exited = asyncio.ensure_future(proc.wait())
        try:
            failures = 0
            while not exited.done():
                await asyncio.wait({exited}, timeout=self.settings.health_interval_s)
                if exited.done():
                    break
                if await self._probe(port):
                    failures = 0
                    self.probes_ok += 1
                    continue
                failures += 1
                if failures >= self.settings.health_failures:
                    self.port = None
                    self.hung += 1
                    self.why = "the inspector stopped answering and is being restarted"
                    log.error(
                        "inspector: pid %s did not answer %d health probes; killing it",
                        proc.pid,
                        failures,
                    )
                    await self._terminate()
                    break
            return await exited
        finally:
            if not exited.done():
                exited.cancel()

    def end_task(self, task_id: str) -> bool:
        """Tell the ready child that `task_id` ended (its summaries and totals are written
        then); never waits. False (nothing sent) when the child is not ready or its stdin
        backlog is full (a hung child): its writer then reports the task when it closes."""
        proc = self.proc
        if not self.ready or proc is None or proc.returncode is not None or proc.stdin is None:
            return False
        stdin = proc.stdin
        if stdin.is_closing() or stdin.transport.get_write_buffer_size() > MAX_CONTROL_BACKLOG:
            self.control_dropped += 1
            return False
        try:
            stdin.write(end_task_line(task_id))  # buffered by the transport, no drain
        except (OSError, RuntimeError):
            self.control_dropped += 1
            return False
        return True

    def _listen_host(self) -> str:
        return self.settings.listen.rpartition(":")[0].strip("[]")

    async def _probe(self, port: int) -> bool:
        """Does the inspector's event loop answer a hand-off connection in time?"""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self._listen_host(), port), self.settings.health_timeout_s
            )
        except (OSError, TimeoutError):
            return False
        try:
            writer.write(health_request())
            line = await asyncio.wait_for(reader.readline(), self.settings.health_timeout_s)
            return line.startswith(b"HTTP/1.1 ")
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def handoff(self, meta: FlowMeta) -> socket.socket:
        """A connected socket whose far end is the inspector, tunnelled to meta's checked
        address; InspectorUnavailable when it cannot be had within handoff_timeout_s."""
        self.attempts += 1
        port = self.port
        if port is None:
            raise InspectorUnavailable(self.why or "the inspector is not running")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.handoff_timeout_s
        host = self._listen_host()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await _connect(loop, sock, (host, port), deadline)
            await loop.sock_sendall(sock, connect_request(meta, self.key))
            await _read_answer(loop, sock, deadline)
            self.handoffs += 1
            return sock
        except TimeoutError:
            sock.close()
            raise InspectorUnavailable("the inspector did not answer in time") from None
        except OSError as e:
            sock.close()
            raise InspectorUnavailable(f"the inspector is unreachable ({e.strerror})") from None
        except BaseException:
            sock.close()
            raise


async def _connect(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, addr: tuple[str, int], deadline: float
) -> None:
    """Connect the non-blocking `sock` by `deadline` (TimeoutError, OSError)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    err = sock.connect_ex(addr)
    if err not in (0, *_IN_PROGRESS):
        raise OSError(err, os.strerror(err))
    if err:
        await wait_fd(loop, sock.fileno(), True, deadline)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))


async def _read_answer(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, deadline: float
) -> None:
    """Read the inspector's answer to the hand-off CONNECT: a `200` head and nothing
    after it (in a TLS tunnel the client speaks first: early bytes mean no tunnel)."""
    answer = bytearray()
    while b"\r\n\r\n" not in answer:
        if len(answer) > MAX_ANSWER:
            raise InspectorUnavailable("the inspector's answer is too long")
        await wait_fd(loop, sock.fileno(), False, deadline)
        chunk = sock.recv(MAX_ANSWER)
        if not chunk:
            raise InspectorUnavailable("the inspector closed the hand-off")
        answer += chunk
    head, _, rest = bytes(answer).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split(b" ")
    if len(status) < 2 or status[1] != b"200" or rest:
        raise InspectorUnavailable("the inspector refused the hand-off")


_IN_PROGRESS = (errno.EINPROGRESS, errno.EINTR, errno.EAGAIN)


def next_delay(previous: float, uptime: float, s: InspectionSettings) -> float:
    """The wait before the next start: restart_delay_s after a child that was up for
    stable_after_s, else double the previous delay (up to restart_delay_max_s), so a
    child that crashes soon after ready (a crash loop) is not restarted every 0.5 s."""
    if uptime >= s.stable_after_s or previous <= 0:
        return s.restart_delay_s
    return min(previous * 2, s.restart_delay_max_s)
