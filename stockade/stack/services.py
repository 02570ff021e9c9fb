"""Run the stack (gateway, broker, the launcher's control service, and a dev OpenBao when no
Vault is configured) as child processes: `stockade up` in the foreground, or around one
`stockade run` on embedded defaults (without the launcher service: that command runs its
own launcher). Readiness is each service's control socket answering /v1/health.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from stockade.config import Config
from stockade.procs import ChildProcess, popen_guarded, stop_group
from stockade.readiness import READY_FD_ENV
from stockade.tasks import ControlClient

from . import prefork
from .devsecrets import SecretValue
from .shared import write_private


class StackError(RuntimeError):
    pass


@dataclass
class Service:
    name: str
    argv: list[str]
    control_socket: str
    log_path: Path | None  # None: inherit the terminal (stockade up)
    # `stockade ...` to fork from this process instead of exec'ing argv (stack/prefork.py;
    # argv stays the way when this process runs other threads)
    fork_argv: list[str] | None = None
    proc: ChildProcess | None = None
    # the read end of the pipe the service says it is ready on (stockade/readiness.py)
    ready_fd: int | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        out: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = out = open(self.log_path, "ab")  # noqa: SIM115 - child owns it
        self.close_ready()
        self.ready_fd, ready_w = os.pipe()
        try:
            self._spawn(out, ready_w)
        finally:
            os.close(ready_w)  # the child's alone now: its exit is our EOF

    def _spawn(self, out: IO[bytes] | None, ready_w: int) -> None:
        if self.fork_argv is not None and prefork.can_fork(trusted=self.name in prefork.TRUSTED):
            self.proc = prefork.fork_service(self.fork_argv, out.fileno() if out else None,
                                             ready_fd=ready_w)
            return
        # dies with its owner (up, the keeper, the demo) even when that one is SIGKILLed:
        # an orphaned gateway would hold the ports and sockets of the next stack
        self.proc = popen_guarded(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # Ctrl-C reaches us; we stop the children in order
            pass_fds=(ready_w,),
            env={**os.environ, READY_FD_ENV: str(ready_w)},
        )

    def close_ready(self) -> None:
        if self.ready_fd is not None:
            os.close(self.ready_fd)
            self.ready_fd = None

    def restart(self) -> None:
        """Start again after the process died (the log file is reopened, appended to)."""
        old = self.proc
        self.stop(timeout=1.0)
        if old is not None:
            # what the dead leader left in its group (the gateway's inspector child)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.pid, signal.SIGKILL)
        self.start()

    def healthy(self) -> bool:
        """Answers ok, and a gateway's L7 inspector (when it runs one) is ready: until then
        flows that need inspection are refused, so a sandbox must not start before."""
        try:
            body = ControlClient(self.control_socket, timeout=1.0).health()
        except (OSError, ValueError, RuntimeError):
            return False
        inspector = body.get("inspector")
        return bool(body.get("ok")) and (not isinstance(inspector, dict)
                                         or bool(inspector.get("ready")))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        stop_group(proc, timeout)
        self.close_ready()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n: int = 1500) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def stack_running(config: Config) -> bool:
    """True when a gateway and a broker already answer on the configured control sockets."""
    for sock in (config.gateway.control_socket, config.broker.control_socket):
        try:
            if not ControlClient(sock, timeout=1.0).health().get("ok"):
                return False
        except (OSError, ValueError, RuntimeError):
            return False
    return True


class Stack:
    """Starts gateway + broker (+ dev OpenBao), then the launcher service, for one config;
    `stop()` leaves nothing behind."""

    def __init__(
        self,
        config: Config,
        *,
        foreground: bool = False,
        startup_timeout: float = 60.0,
        launcher_service: bool = True,
        fork: bool = False,
    ) -> None:
        """`fork`: gateway and broker are forked from this process once it imported their
        modules (stack/prefork.py: the embedded stack's keeper), not exec'd."""
        self.base = config
        self.fork = fork
        self.config = config  # the effective config, with the dev Vault filled in
        self.foreground = foreground
        self.launcher_service = launcher_service
        self.startup_timeout = startup_timeout
        self.services: list[Service] = []
        self.dev_vault: object | None = None
        self.run_dir = Path(config.run_dir)
        self.config_file: Path | None = None  # the effective config the children read
        self._files: list[Path] = []
        self._dev_secrets: list[SecretValue] = []
        self._dev_vault_port: int | None = None  # the dev OpenBao's, once chosen

    def own_file(self, path: Path) -> None:
        """Remove `path` at stop() too."""
        self._files.append(path)

    def _write_private(self, path: Path, text: str) -> Path:
        self._files.append(write_private(path, text))
        return path

    def start(self) -> Config:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self.config

    def _start(self) -> None:
        # the gateway needs no Vault: it starts first, before this process holds the dev
        # OpenBao's root token or any secret (it may be forked: stack/prefork.py), and
        # boots while the OpenBao does; the broker logs in at its start, so it starts once
        # the OpenBao answers with its secrets
        self.config = cfg = self._with_dev_vault(self.base)
        self.config_file = cfg_path = self._write_private(
            self.run_dir / "stack-config.yaml",
            yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False),
        )
        deadline = time.monotonic() + self.startup_timeout
        gateway = self._launch("gateway", cfg.gateway.control_socket, cfg_path)
        bao = self._launch_dev_vault(cfg) if self._dev_vault_port is not None else None
        if bao is not None:
            self._dev_vault_ready(bao)
        broker = self._launch("broker", cfg.broker.control_socket, cfg_path)
        self._wait_ready([gateway, broker], deadline)
        if self.launcher_service:
            # after gateway and broker answer: the launcher registers every sandbox with both
            launcher = self._launch("launcher", cfg.launcher.control_socket, cfg_path)
            self._wait_ready([launcher], deadline)

    def _with_dev_vault(self, cfg: Config) -> Config:
        """Without vault.address (and the dev OpenBao not left out): `cfg` with the dev
        OpenBao's address and root token file, chosen before it exists; else `cfg`."""
        if cfg.vault.address is not None or not cfg.dev_vault.enabled:
            return cfg
        from stockade.ports import free_port

        self._dev_vault_port = cfg.dev_vault.port or free_port()
        vault = cfg.vault.model_copy(update={
            "address": f"http://127.0.0.1:{self._dev_vault_port}",
            "token_file": str(self.run_dir / "dev-vault-token")})
        return cfg.model_copy(update={"vault": vault})

    def _launch_dev_vault(self, cfg: Config) -> Any:
        """The dev OpenBao of `cfg` (`_with_dev_vault`) launched, not yet ready, its root
        token in the token file and the configured secrets read."""
        from stockade.testing.devvault import DevOpenBao

        from .devsecrets import SecretSpecError, from_settings

        prefork.hold_secrets()  # from here: the token and the secrets' values
        try:
            self._dev_secrets = from_settings(cfg.dev_vault.secrets)
        except SecretSpecError as e:
            raise StackError(str(e)) from None
        bao = DevOpenBao(port=self._dev_vault_port).launch()
        self.dev_vault = bao
        assert cfg.vault.token_file is not None and bao.address == cfg.vault.address
        self._write_private(Path(cfg.vault.token_file), bao.root_token)
        return bao

    def _dev_vault_ready(self, bao: Any) -> None:
        from .devsecrets import put_secrets

        bao.wait_ready()
        put_secrets(bao.address, bao.root_token, self._dev_secrets)

    def _launch(self, name: str, sock: str, cfg_path: Path) -> Service:
        command = [name, "serve", "--config", str(cfg_path)]
        fork = self.fork and name in prefork.PRELOAD and \
            prefork.can_fork(trusted=name in prefork.TRUSTED)
        if fork:
            prefork.preload(name)
        svc = Service(
            name=name,
            argv=[sys.executable, "-m", "stockade", *command],
            control_socket=sock,
            log_path=None if self.foreground else Path(self.config.log_dir) / f"{name}.log",
            fork_argv=command if fork else None,
        )
        svc.start()
        self.services.append(svc)
        return svc

    def _wait_ready(self, services: list[Service], deadline: float) -> None:
        """Until each service said it serves on its ready pipe (no polling; EOF first: it
        ended), and then answers its health check."""
        pending = {svc.ready_fd: svc for svc in services if svc.ready_fd is not None}
        while pending:
            left = deadline - time.monotonic()
            readable = select.select(list(pending), [], [], max(left, 0.0))[0]
            if not readable:
                self._not_ready(list(pending.values()))
            for fd in readable:
                svc = pending.pop(fd)
                said = os.read(fd, 1) == b"R"
                svc.close_ready()
                if not said:
                    raise StackError(f"{svc.name} exited during start-up:\n{svc.log_tail()}")
        # serving is not yet ready where a gateway's L7 inspector still starts: those
        # (and a service that had no pipe) are asked until they are
        self._poll_ready([svc for svc in services if not svc.healthy()], deadline)

    def _poll_ready(self, services: list[Service], deadline: float) -> None:
        pending = list(services)
        while pending:
            for svc in list(pending):
                if not svc.alive():
                    raise StackError(f"{svc.name} exited during start-up:\n{svc.log_tail()}")
                if svc.healthy():
                    pending.remove(svc)
            if pending and time.monotonic() > deadline:
                self._not_ready(pending)
            if pending:
                time.sleep(0.05)

    def _not_ready(self, pending: list[Service]) -> None:
        names = ", ".join(s.name for s in pending)
        raise StackError(f"not ready after {self.startup_timeout:.0f}s: {names}")

    def status(self) -> list[tuple[str, int | None, str]]:
        rows: list[tuple[str, int | None, str]] = []
        bao = self.dev_vault
        if bao is not None:
            proc = getattr(bao, "proc", None)
            rows.append(
                (
                    "openbao (dev)",
                    proc.pid if proc else None,
                    "running" if getattr(bao, "running", False) else "stopped",
                )
            )
        for svc in self.services:
            state = (
                "ready"
                if svc.alive() and svc.healthy()
                else ("running" if svc.alive() else "stopped")
            )
            rows.append((svc.name, svc.proc.pid if svc.proc else None, state))
        return rows

    def stop(self) -> None:
        for svc in self.services:
            if svc.name == "launcher":
                # first, with more time: it kills and tears down its sandboxes
                # (deregistering them from the gateway and broker that are still up)
                svc.stop(timeout=30.0)
        bao, self.dev_vault = self.dev_vault, None
        stops = [svc.stop for svc in self.services if svc.name != "launcher"]
        if bao is not None:
            stops.append(bao.stop)  # type: ignore[attr-defined]
        # the rest depend on nothing of each other: stopped at once, not one after the
        # other (each takes a process exit; in turn they were most of a run's last second)
        with ThreadPoolExecutor(max_workers=max(1, len(stops))) as pool:
            for done in [pool.submit(stop) for stop in stops]:
                done.result()
        self.services.clear()
        for f in self._files:
            f.unlink(missing_ok=True)
        self._files.clear()
        socks = [self.config.gateway.control_socket, self.config.broker.control_socket]
        if self.launcher_service:
            socks.append(self.config.launcher.control_socket)
        for sock in socks:
            Path(sock).unlink(missing_ok=True)


@contextlib.contextmanager
def ensure_stack(config: Config, secrets: Sequence[SecretValue] = (), *,
                 while_starting: Callable[[], None] | None = None,
                 fork: bool = False) -> Iterator[Config]:
    """Join the run_dir's stack (shared by concurrent runs, or `stockade up`'s), starting
    one when there is none; the last run out stops a shared one (see stack.shared).
    `secrets` go into its dev OpenBao (an error when it has none). `while_starting` runs
    once the keeper of a stack started here is on its way, before waiting for it; `fork`:
    see `embedded.join`."""
    from .embedded import join, leave

    try:
        joined = join(config, while_starting=while_starting, fork=fork)
    except OSError as e:  # run_dir or log_dir unusable (permissions, a full disk)
        raise StackError(f"cannot start or join the stack in {config.run_dir}: {e}") from None
    try:
        if secrets:
            put_dev_secrets(joined.config, joined.state is not None and joined.state.dev_vault,
                            secrets)
        yield joined.config
    finally:
        leave(joined)


def put_dev_secrets(effective: Config, dev_vault: bool, secrets: Sequence[SecretValue]) -> None:
    """Write secrets into the stack's dev OpenBao through its root token file."""
    from .devsecrets import put_secrets

    address, token_file = effective.vault.address, effective.vault.token_file
    if not dev_vault or not address or not token_file:
        raise StackError("--secret needs the embedded dev OpenBao, and the running stack "
                         "uses a configured Vault: put the secret into that Vault instead")
    try:
        token = Path(token_file).read_text().strip()
        put_secrets(address, token, secrets)
    except OSError as e:
        raise StackError(f"cannot put the secrets into the dev OpenBao: {e}") from None
    except Exception as e:  # hvac errors carry URLs and bodies: name the type only
        name = type(e).__name__
        raise StackError(f"cannot put the secrets into the dev OpenBao: {name}") from None
