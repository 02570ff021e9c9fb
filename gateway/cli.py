"""`stockade gateway serve --config FILE`."""

from __future__ import annotations

import argparse

from stockade.clikit import add_config_args, add_log_level, setup_logging

DEFAULTS = "stockade.yaml (default: built-in defaults)"


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
    add_config_args(serve, help_text=DEFAULTS, short=False)
    serve.add_argument(
        "--no-dns", action="store_true", help="do not start the DNS firewall (TCP listeners only)"
    )
    add_log_level(serve)
    serve.set_defaults(func=run_serve)
    ca = gsub.add_parser(
        "ca",
        help="print the path of the inspection CA certificate (sandboxes trust it)",
        description="Print the path of the PEM certificate of the CA the gateway's L7 "
        "inspector signs its certificates with, creating the CA (in the state directory, "
        "key 0600) if it does not exist yet. Sandboxes must trust it for flows whose allow "
        "entries have an `http:` block (the system bundle path, SSL_CERT_FILE, PIP_CERT, "
        "NODE_EXTRA_CA_CERTS).",
    )
    add_config_args(ca, help_text=DEFAULTS, short=False)
    ca.add_argument("--pem", action="store_true", help="print the certificate itself")
    ca.set_defaults(func=run_ca)
    insp = gsub.add_parser(
        "inspector",
        help="the L7 inspector child process (started by `gateway serve`, not by hand)",
        description="Run the mitmproxy-based L7 inspector. The gateway starts it, writes its "
        "spec (one JSON line with a signing key) on stdin and supervises it; it exits when "
        "its stdin closes.",
    )
    insp.set_defaults(func=run_inspector)


def run_serve(args: argparse.Namespace) -> int:
    from stockade.serving import run

    from .service import serve

    setup_logging(args.log_level)
    config = args.config_loader(args.config, "gateway")
    # uvloop (gateway.uvloop, on by default) halves the per-connection loop overhead
    return run(serve(config, dns=not args.no_dns), uvloop=config.gateway.uvloop)


def run_ca(args: argparse.Namespace) -> int:
    from stockade.trust import inspection_ca_cert

    path = inspection_ca_cert(args.config_loader(args.config, "gateway ca"))
    print(path.read_text() if args.pem else path, end="" if args.pem else "\n")
    return 0


def run_inspector(args: argparse.Namespace) -> int:
    from .inspector import main

    return main()
