"""`stockade run`: one command in a fresh sandbox, with the stack it needs (a running
`stockade up`, or gateway, broker and a dev OpenBao for this command only). On the top
floor because it composes the components; the launcher's own commands stay in
stockade/launcher/cli.py."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from typing import Any

from stockade.clikit import add_config_args

from .devsecrets import ARG_HELP as SECRET_HELP


def _parse_input(raw: str) -> tuple[str, str]:
    host, sep, guest = raw.partition(":")
    if not sep or not guest:
        guest = "/inputs/" + os.path.basename(os.path.normpath(host))
    return host, guest


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    run = sub.add_parser("run", help="run a command in a fresh sandbox and tear it down")
    run.add_argument("--profile", required=True, help="profile name from the rules")
    run.add_argument("--rules", help="rules directory (default: config rules_dir)")
    add_config_args(run, help_text="stockade.yaml (default: embedded defaults)", short=False)
    run.add_argument("--input", action="append", default=[], metavar="HOST_PATH[:GUEST_PATH]",
                     help="mount read-only (default guest path /inputs/<name>); repeatable; "
                          "never at or under what the sandbox's init relies on (`/usr`, `/bin`, "
                          "`/sbin`, `/lib*`, `/etc`, `/sbx`, `/init`, `ro_binds`, the scratch, "
                          "`/tmp`, `/proc`, `/dev`, `/sys`)")
    run.add_argument("--export", metavar="DIR", help="copy allowed files of scratch/out here")
    run.add_argument("--ttl", type=int, metavar="SECONDS",
                     help="wall-clock limit (capped by the profile's limits.ttl)")
    run.add_argument("--json", action="store_true", help="print one JSON result object")
    run.add_argument("--quiet", "-q", action="store_true",
                     help="no progress lines and no denial summary on stderr (--json: never)")
    run.add_argument("--secret", action="append", default=[], metavar="PATH:FIELD=@FILE",
                     help=SECRET_HELP)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=_run)


def _prepare(args: argparse.Namespace) -> int | tuple[list[str], Any, Any, Any, Any]:
    """The command, the file's and the effective config, the rules and the secrets, each
    checked before any service starts; an exit code (2) with the reason on stderr when one
    is bad."""
    # the modules that define these, not launcher.core: the launcher itself is imported
    # while a stack this run starts boots (ensure_stack's `while_starting`)
    from stockade.launcher.isolation import preflight
    from stockade.launcher.spec import LauncherError

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("stockade run: missing command after --", file=sys.stderr)
        return 2
    file_config = args.config_loader(args.config, "run")
    # the stack this run starts loads --rules too: the gateway and the broker must decide
    # with the rules the sandbox was checked against, not the file's rules_dir
    config = (file_config.model_copy(update={"rules_dir": args.rules}) if args.rules
              else file_config)
    try:
        from stockade.policy import load_rules  # type: ignore[attr-defined]

        ruleset = load_rules(config.rules_dir)
    except Exception as e:
        print(f"stockade run: {e}", file=sys.stderr)
        return 2
    try:
        preflight(config.launcher, ruleset, args.profile)
    except LauncherError as e:
        print(f"stockade run: {e}", file=sys.stderr)
        return 2
    from .devsecrets import SecretSpecError, parse_secret_args

    try:
        secrets = parse_secret_args(args.secret)
    except SecretSpecError as e:
        print(f"stockade run: {e}", file=sys.stderr)
        return 2
    if secrets:  # their values are in memory now: the keeper is exec'd, not forked
        from .prefork import hold_secrets

        hold_secrets()
    return cmd, file_config, config, ruleset, secrets


def _run(args: argparse.Namespace) -> int:
    prepared = _prepare(args)
    if isinstance(prepared, int):
        return prepared
    cmd, file_config, config, ruleset, secrets = prepared
    from stockade.launcher.spec import LauncherError, SandboxSpec

    spec = SandboxSpec(profile=args.profile, argv=cmd,
                       inputs=[_parse_input(i) for i in args.input],
                       export_dir=args.export, ttl=args.ttl)
    from .progress import Progress
    from .services import StackError, ensure_stack, stack_running

    # a running stack's launcher service decides with the file's rules: only when this
    # run reads the same ones may it claim a sandbox there
    same_rules = not args.rules or (
        os.path.realpath(args.rules) == os.path.realpath(file_config.rules_dir))
    if not stack_running(config):
        # a stack this run starts (or shares with runs like it) leaves out what the rules
        # never use; a running one (`stockade up`) is used as it is
        from .lean import without_unneeded_inspector, without_unneeded_vault

        config = without_unneeded_vault(without_unneeded_inspector(config, ruleset), ruleset,
                                        bool(secrets))
    progress = Progress(None if args.json or args.quiet else sys.stderr)
    try:
        # a running stack (`stockade up`) is used as it is; otherwise gateway, broker and
        # (without vault.address) a dev OpenBao run for this command only
        with contextlib.ExitStack() as stack:
            parts = "gateway, broker" + (", OpenBao" if config.dev_vault.enabled else "")
            with progress.phase(f"joining or starting the stack ({parts})", "stack ready"):
                effective = stack.enter_context(ensure_stack(
                    config, secrets, while_starting=_import_launcher, fork=True))
            progress.begin_sandbox()
            result = _run_sandbox(effective, spec, ruleset, progress, same_rules)
    except (LauncherError, StackError, OSError) as e:  # OSError: a full or read-only disk
        print(f"stockade run: {e}", file=sys.stderr)
        return 2
    _print_result(result, args.json)
    progress.summary(result.denials)
    return result.exit_code


def _import_launcher() -> None:
    """While the keeper starts the stack (its own start-up leaves a core idle) rather than
    before: the run's launcher, about a tenth of a second of imports."""
    importlib.import_module("stockade.launcher.core")


def _run_sandbox(effective: Any, spec: Any, ruleset: Any, progress: Any,
                 same_rules: bool) -> Any:
    """The run's sandbox: claimed through the running stack's launcher service when it
    keeps warm pools (it decides with its own rules, so only when this run reads the same
    rules directory), else from a launcher of this run's own."""
    from stockade.launcher.core import Launcher

    service = _pooled_service(effective) if same_rules else None
    if service is not None:
        return _run_in_service(service, spec)
    launcher = Launcher(effective)
    launcher.events.subscribe(progress.on_event)
    try:
        return launcher.run(spec, ruleset)
    finally:
        launcher.close()


def _pooled_service(effective: Any) -> Any | None:
    """The running stack's launcher service when it keeps warm pools (`stockade up` with
    `launcher.pools`), else None: this command then runs its own launcher."""
    sock = effective.launcher.control_socket
    if not os.path.exists(sock):
        # no service (an embedded stack runs none): spare the import of its client's
        # module, which loads aiohttp (a good part of a short run's wall time)
        return None
    from stockade.launcher.service import LauncherClient

    client = LauncherClient(sock, timeout=2.0)
    try:
        health = client.health()
    except (OSError, ValueError, RuntimeError):  # no service, or one that does not answer
        return None
    return client if health.get("ok") and health.get("pools") else None


def _run_in_service(client: Any, spec: Any) -> Any:
    from stockade.launcher.spec import LauncherError
    from stockade.tasks import ControlError

    try:
        return client.run(spec)
    except ControlError as e:  # the service's refusal, in its own words
        raise LauncherError(f"the launcher service refused: {e.describe()}") from None


def _print_result(result: Any, as_json: bool) -> None:
    """The sandbox's output on ours (or one JSON object), then why it was cut or ended."""
    if as_json:
        print(json.dumps(result.to_json()))
        return
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
