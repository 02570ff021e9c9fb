"""`stockade gateway serve --config FILE`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Coroutine
from typing import Any


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    group = sub.add_parser("gateway", help="the egress gateway (TCP listeners + DNS firewall)")
    gsub = group.add_subparsers(dest="gateway_command", metavar="COMMAND")
    group.set_defaults(group_parser=group)
    serve = gsub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the egress gateway: transparent and explicit-proxy TCP listeners, "
        "the DNS firewall, the control API and Prometheus metrics, as configured in the "
        "`gateway:` and `dns:` sections of stockade.yaml. SIGHUP reloads the rules.",
    )
    serve.add_argument("--config", help="stockade.yaml (default: built-in defaults)")
    serve.add_argument(
        "--no-dns", action="store_true", help="do not start the DNS firewall (TCP listeners only)"
    )
    serve.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="diagnostic log level on stderr (events go to the events file)",
    )
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import logging

    from stockade.policy import RulesError

    from stockade.cli import config_or_fail

    from .service import serve

    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = config_or_fail(args.config, "gateway")
    try:
        return run_loop(serve(config, dns=not args.no_dns), config.gateway.uvloop)
    except RulesError as e:
        print(f"stockade gateway: rules invalid, not starting:\n{e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"stockade gateway: {e}", file=sys.stderr)
        return 1


def run_loop(main: Coroutine[Any, Any, int], want_uvloop: bool) -> int:
    """uvloop when installed and wanted (its C event loop halves per-connection overhead)."""
    import asyncio

    if want_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)
