"""The stack: `stockade up` (all services in the foreground), `stockade demo`, and the
embedded-defaults mode of `stockade run` (see services.ensure_stack)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .devsecrets import ARG_HELP as SECRET_HELP


def add_commands(sub: Any) -> None:
    up = sub.add_parser(
        "up",
        help="run gateway, broker, launcher service (and a dev OpenBao) in the foreground",
        description="Run the gateway, the broker, the launcher's control service and, when no "
        "vault.address is configured, a dev OpenBao, as separate processes with readiness "
        "checks and a status line each. A component that dies is restarted with backoff (a "
        "component_restarted event); Ctrl-C stops them all.",
    )
    up.add_argument("--config", "-c", metavar="FILE", help="stockade.yaml (default: built-in)")
    up.add_argument("--secret", action="append", default=[], metavar="PATH:FIELD=@FILE",
                    help=SECRET_HELP)
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

    from stockade.cli import config_or_fail

    from .devsecrets import SecretSpecError, parse_secret_args
    from .up import run_up

    cfg = config_or_fail(args.config, "up")
    try:
        secrets = parse_secret_args(args.secret)
    except SecretSpecError as e:
        print(f"stockade up: {e}", file=sys.stderr)
        return 2

    def stop_on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_term)
    return run_up(cfg, secrets)
