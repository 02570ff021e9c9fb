"""The stack: `stockade up` (all services in the foreground), `stockade demo`, and the
embedded-defaults mode of `stockade run` (see services.ensure_stack)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_commands(sub: Any) -> None:
    up = sub.add_parser(
        "up",
        help="run gateway, broker, launcher service (and a dev OpenBao) in the foreground",
        description="Run the gateway, the broker, the launcher's control service and, when no "
        "vault.address is configured, a dev OpenBao, as separate processes with readiness "
        "checks and a status line each. Ctrl-C stops them all.",
    )
    up.add_argument("--config", "-c", metavar="FILE", help="stockade.yaml (default: built-in)")
    up.set_defaults(func=_up)
    demo = sub.add_parser(
        "demo",
        help="offline end-to-end demo (fake internet, sandboxed agent)",
        description="Build a fake internet, start the stack with a dev OpenBao, run an agent "
        "in a sandbox that works and misbehaves, and check every step. Exit 0 only when every "
        "step behaved as expected. Needs root; works offline.",
    )
    demo.add_argument("--json", action="store_true", help="print the result as one JSON object")
    demo.add_argument("--keep-logs", metavar="DIR", help="copy the services' logs and events here")
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(json_out=args.json, keep_logs=args.keep_logs)


def _up(args: argparse.Namespace) -> int:
    import signal
    import time

    from stockade.cli import config_or_fail

    from .services import Stack, StackError, stack_running

    cfg = config_or_fail(args.config, "up")
    if stack_running(cfg):
        print("stockade up: a stack is already running on these control sockets", file=sys.stderr)
        return 1

    def stop_on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_term)
    stack = Stack(cfg, foreground=True)
    try:
        eff = stack.start()
        for name, pid, state in stack.status():
            print(f"stockade up: {name:<14} pid {pid}  {state}", file=sys.stderr)
        if stack.dev_vault is not None:
            print(
                f"stockade up: dev OpenBao at {eff.vault.address}; root token in "
                f"{eff.vault.token_file} (put API keys there)",
                file=sys.stderr,
            )
        print(
            f"stockade up: sandbox API on {eff.launcher.control_socket} "
            "(stockade.launcher.service.LauncherClient)",
            file=sys.stderr,
        )
        print("stockade up: ready (Ctrl-C stops everything)", file=sys.stderr, flush=True)
        while all(state != "stopped" for _, _, state in stack.status()):
            time.sleep(1.0)
        print("stockade up: a component stopped; shutting down", file=sys.stderr)
        return 1
    except StackError as e:
        print(f"stockade up: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstockade up: stopping", file=sys.stderr)
        return 0
    finally:
        stack.stop()
