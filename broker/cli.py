"""`stockade broker serve --config FILE`: run the credential broker in the foreground."""

from __future__ import annotations

import argparse
import gc
import logging
from typing import Any

from stockade.clikit import add_config_args, setup_logging


def add_commands(sub: Any) -> None:
    p = sub.add_parser("broker", help="credential broker")
    p.set_defaults(group_parser=p)
    bsub = p.add_subparsers(dest="broker_command", metavar="COMMAND")
    serve = bsub.add_parser("serve", help="run the broker in the foreground")
    add_config_args(serve)
    serve.add_argument("--listen", metavar="HOST:PORT", help="override broker.listen")
    serve.add_argument("--rules", metavar="DIR", help="override rules_dir")
    serve.add_argument(
        "--dev-vault",
        action="store_true",
        help="when vault.address is unset, start a throw-away OpenBao dev server (demo only)",
    )
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from stockade.serving import run

    setup_logging(logging.INFO)
    cfg = args.config_loader(
        args.config, "broker", rules_dir=args.rules, broker={"listen": args.listen}
    )
    # uvloop when installed: about a quarter less CPU per proxied call
    return run(_run(cfg, args.dev_vault))


async def _run(cfg: Any, dev_vault: bool) -> int:
    from stockade.policy import RulesError

    from stockade.serving import serve_until_signalled

    from .service import BrokerService

    svc = BrokerService(cfg, dev_vault=dev_vault)

    def reload() -> Any:
        # before start-up finished there is nothing to reload yet
        return svc.reload("sighup") if svc.broker is not None else None

    def banner() -> str:
        assert svc.listen_address is not None
        host, port = svc.listen_address
        return f"listening on {host}:{port}"

    async def start() -> None:
        await svc.start()
        settle_gc()

    # a SIGTERM during start-up also stops a dev OpenBao started on the way
    return await serve_until_signalled(
        "broker", start=start, stop=svc.stop, reload=reload, banner=banner,
        start_errors=(ValueError, OSError), invalid_rules=(RulesError,),
    )


YOUNG_GC_THRESHOLD = 20_000


def settle_gc() -> None:
    """Garbage-collector settings for a process that only serves calls (not for embedders
    like `stockade run`, which share their process). The start-up heap (rules, aiohttp,
    hvac, prometheus: ~70k objects) never becomes garbage: frozen, full collections stop
    re-scanning it on the call path (milliseconds each). A call allocates a few hundred
    containers, so at the default threshold of 700 a young collection ran every other
    call; at 20k it runs every ~50 calls for about the same work per collection (what is
    scanned is what is still alive: the calls in flight), and cycles wait that much longer
    (a few MB at most)."""
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_GC_THRESHOLD), *older)
