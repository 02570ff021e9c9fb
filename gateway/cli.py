"""`stockade gateway serve --config FILE`."""

from __future__ import annotations

import argparse
import sys


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

    from stockade.cli import config_or_fail
    from stockade.serving import run

    from .service import serve

    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = config_or_fail(args.config, "gateway")
    # uvloop (gateway.uvloop, on by default) halves the per-connection loop overhead
    return run(serve(config, dns=not args.no_dns), uvloop=config.gateway.uvloop)
