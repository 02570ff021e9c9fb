"""`stockade run`, `stockade sandbox list|kill|suspend|resume` and `stockade launcher serve`
(thin shells over Launcher and launcher.service)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from stockade.stack.devsecrets import ARG_HELP as SECRET_HELP


def _parse_input(raw: str) -> tuple[str, str]:
    host, sep, guest = raw.partition(":")
    if not sep or not guest:
        guest = "/inputs/" + os.path.basename(os.path.normpath(host))
    return host, guest


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    run = sub.add_parser("run", help="run a command in a fresh sandbox and tear it down")
    run.add_argument("--profile", required=True, help="profile name from the rules")
    run.add_argument("--rules", help="rules directory (default: config rules_dir)")
    run.add_argument("--config", help="stockade.yaml (default: embedded defaults)")
    run.add_argument("--input", action="append", default=[], metavar="HOST_PATH[:GUEST_PATH]",
                     help="mount read-only (default guest path /inputs/<name>); repeatable; "
                          "never at or under what the sandbox's init relies on (`/usr`, `/bin`, "
                          "`/sbin`, `/lib*`, `/etc`, `/sbx`, `/init`, `ro_binds`, the scratch, "
                          "`/tmp`, `/proc`, `/dev`, `/sys`)")
    run.add_argument("--export", metavar="DIR", help="copy allowed files of scratch/out here")
    run.add_argument("--ttl", type=int, metavar="SECONDS",
                     help="wall-clock limit (capped by the profile's limits.ttl)")
    run.add_argument("--json", action="store_true", help="print one JSON result object")
    run.add_argument("--secret", action="append", default=[], metavar="PATH:FIELD=@FILE",
                     help=SECRET_HELP)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=_run)

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
    serve.add_argument("--config", "-c", metavar="FILE", help="stockade.yaml (default: built-in)")
    serve.add_argument("--rules", metavar="DIR", help="override rules_dir")
    serve.add_argument("--socket", metavar="PATH", help="override launcher.control_socket")
    serve.set_defaults(func=_serve)


def _launcher(config_path: str | None, command: str) -> Any:
    from stockade.cli import config_or_fail

    from .core import Launcher

    return Launcher(config_or_fail(config_path, command))


def _run(args: argparse.Namespace) -> int:
    from stockade.cli import config_or_fail

    from .core import Launcher, LauncherError, SandboxSpec, preflight

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("stockade run: missing command after --", file=sys.stderr)
        return 2
    config = config_or_fail(args.config, "run")
    try:
        from stockade.policy import load_rules  # type: ignore[attr-defined]

        ruleset = load_rules(args.rules or config.rules_dir)
    except Exception as e:
        print(f"stockade run: {e}", file=sys.stderr)
        return 2
    try:
        preflight(config.launcher, ruleset, args.profile)  # before any service starts
    except LauncherError as e:
        print(f"stockade run: {e}", file=sys.stderr)
        return 2
    from stockade.stack.devsecrets import SecretSpecError, parse_secret_args

    try:
        secrets = parse_secret_args(args.secret)  # before any service starts
    except SecretSpecError as e:
        print(f"stockade run: {e}", file=sys.stderr)
        return 2
    spec = SandboxSpec(profile=args.profile, argv=cmd,
                       inputs=[_parse_input(i) for i in args.input],
                       export_dir=args.export, ttl=args.ttl)
    from stockade.stack.services import StackError, ensure_stack

    try:
        # a running stack (`stockade up`) is used as it is; otherwise gateway, broker and
        # (without vault.address) a dev OpenBao run for this command only
        with ensure_stack(config, secrets) as effective:
            launcher = Launcher(effective)
            try:
                result = launcher.run(spec, ruleset)
            finally:
                launcher.close()
    except (LauncherError, StackError, OSError) as e:  # OSError: a full or read-only disk
        print(f"stockade run: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        for name in ("stdout", "stderr"):
            if getattr(result, f"{name}_truncated"):
                print(f"stockade run: {name} truncated: kept {len(getattr(result, name))} "
                      f"characters of {getattr(result, f'{name}_bytes')} bytes "
                      "(launcher.max_output_bytes)", file=sys.stderr)
        if result.ended_by != "exit":
            print(f"stockade run: sandbox {result.task_id} ended by {result.ended_by}",
                  file=sys.stderr)
    return result.exit_code


def _list(args: argparse.Namespace) -> int:
    rows = _launcher(args.config, "sandbox list").list()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'TASK':<12} {'PROFILE':<20} {'ADDRESS':<16} {'ISOLATION':<10} STATE")
    for r in rows:
        print(f"{r['task_id']:<12} {r['profile']:<20} {r['address']:<16} "
              f"{r['isolation']:<10} {r['state']}")
    return 0


def _op(args: argparse.Namespace) -> int:
    launcher = _launcher(args.config, f"sandbox {args.op}")
    ok = getattr(launcher, args.op)(args.task_id)
    if not ok:
        print(f"stockade sandbox {args.op}: no sandbox {args.task_id}", file=sys.stderr)
        return 1
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from stockade.cli import config_or_fail

    from .service import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_or_fail(
        args.config, "launcher", rules_dir=args.rules, launcher={"control_socket": args.socket}
    )
    return asyncio.run(serve(cfg))
