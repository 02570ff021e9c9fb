"""`stockade sandbox list|kill|suspend|resume` and `stockade launcher serve` (thin shells
over Launcher and launcher.service; `stockade run`, which also starts the stack, is
stockade/stack/run.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from stockade.clikit import add_config_args, setup_logging


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    sb = sub.add_parser("sandbox", help="list, kill, suspend, resume sandboxes")
    sb.set_defaults(group_parser=sb)
    sbsub = sb.add_subparsers(dest="sandbox_command", metavar="COMMAND")
    lst = sbsub.add_parser("list", help="live sandboxes")
    lst.add_argument("--config")
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=_list)
    for name, helptext in (("kill", "kill and remove a sandbox"),
                           ("suspend", "freeze every process of a sandbox"),
                           ("resume", "thaw a suspended sandbox")):
        p = sbsub.add_parser(name, help=helptext)
        p.add_argument("task_id")
        p.add_argument("--config")
        p.set_defaults(func=_op, op=name)

    lg = sub.add_parser("launcher", help="the launcher's control service (API for orchestrators)")
    lg.set_defaults(group_parser=lg)
    lgsub = lg.add_subparsers(dest="launcher_command", metavar="COMMAND")
    serve = lgsub.add_parser(
        "serve", help="serve the sandbox API on launcher.control_socket in the foreground",
        description="Run sandboxes on request over a root-only Unix socket (run, list, kill, "
        "suspend, resume). SIGHUP reloads the rules; SIGTERM/SIGINT kill the service's "
        "sandboxes and remove the nft table.")
    add_config_args(serve)
    serve.add_argument("--rules", metavar="DIR", help="override rules_dir")
    serve.add_argument("--socket", metavar="PATH", help="override launcher.control_socket")
    serve.set_defaults(func=_serve)


def _list(args: argparse.Namespace) -> int:
    # the state file is the whole answer: no launcher (event writer, backends) is needed
    from .state import StateFile, state_path

    cfg = args.config_loader(args.config, "sandbox list", peek=True)
    records = StateFile(state_path(cfg.state_dir, cfg.launcher.nft_table)).read()
    rows = [r.summary() for r in records.values()]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'TASK':<12} {'PROFILE':<20} {'ADDRESS':<16} {'ISOLATION':<10} STATE")
    for r in rows:
        # a warm-pool sandbox belongs to no task yet: no profile
        print(f"{r['task_id']:<12} {r['profile'] or '-':<20} {r['address']:<16} "
              f"{r['isolation']:<10} {r['state']}")
    ready = Counter(r["pool"] for r in rows if r["state"] == "pooled")
    for pool, n in sorted(ready.items()):
        print(f"pool {pool}: {n} ready")
    return 0


def _op(args: argparse.Namespace) -> int:
    # no Launcher unless the kill must tear down itself: the operator's event and the
    # sandbox's cgroups are the whole work while its owner runs (launcher/operator.py)
    from .operator import freeze, kill
    from .state import StateFile, state_path

    command = f"sandbox {args.op}"
    # a kill reads a few keys (configpeek, no pydantic); suspend and resume the tier's
    # settings too (the backend pauses); a Launcher reads more
    cfg = args.config_loader(args.config, command, peek=args.op == "kill",
                             launcher_only=args.op != "kill")
    state = StateFile(state_path(cfg.state_dir, cfg.launcher.nft_table))
    events = cfg.event_writer(stdout=False)
    if args.op == "kill":
        ok = kill(state, cfg.launcher, args.task_id, events.write, cfg.task_events_dir)
        if ok is None:  # its owner is gone or did not answer: this process tears it down
            from .core import Launcher

            full = args.config_loader(args.config, command)
            Launcher(full, events=events).end_orphan(args.task_id, "killed")
            ok = True
    else:
        ok = freeze(state, cfg.launcher, args.task_id, args.op == "suspend", events.write)
    if not ok:
        print(f"stockade sandbox {args.op}: no sandbox {args.task_id}", file=sys.stderr)
        return 1
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from .service import serve

    setup_logging("INFO")
    cfg = args.config_loader(
        args.config, "launcher", rules_dir=args.rules, launcher={"control_socket": args.socket}
    )
    return asyncio.run(serve(cfg))
