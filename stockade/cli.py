"""`stockade`: one entry point, one subcommand group per component.

Each component module exposes `add_commands(subparsers)` and keeps its heavy imports
inside the handlers, so `stockade --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stockade.config import Config

# module -> the top-level commands it adds; order is the order in --help. The parser of
# one command imports only its module (`stockade sandbox kill` does not pay for the rule
# schema, pydantic or aiohttp); `--help` and an unknown command import them all.
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "stockade.policy.cli": ("rules",),  # rules lint|explain|test|diff|...
    "stockade.gateway.cli": ("gateway",),  # gateway serve
    "stockade.broker.cli": ("broker",),  # broker serve
    "stockade.stack.run": ("run",),  # run (the stack plus a launcher of its own)
    "stockade.launcher.cli": ("sandbox", "launcher"),  # sandbox list|kill|..., launcher serve
    "stockade.stack": ("up", "demo"),
    "stockade.events.cli": ("events",),
    "stockade.mcp.cli": ("mcp",),  # mcp (the session API for MCP clients)
    "stockade.stack.taskcli": ("task",),  # task verify
}


def modules_for(argv: Sequence[str] | None) -> list[str]:
    """The modules whose commands the parser of `argv` needs: the one that owns its
    command word, or all of them (no command, `--help`, an unknown or misspelt word: the
    error lists every command)."""
    word = next((a for a in argv if not a.startswith("-")), None) if argv else None
    if word is None and argv and "--version" in argv and not {"-h", "--help"} & set(argv):
        return []  # argparse prints the version and exits before any command matters
    for module, commands in COMMAND_MODULES.items():
        if word in commands:
            return [module]
    return list(COMMAND_MODULES)


class CommandFailed(Exception):
    """Ends a command with a message on stderr and an exit code (`main` prints it), so a
    helper deep in a handler can refuse without every caller checking a return value."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def config_or_fail(
    path: str | None, command: str, *, rules_dir: str | None = None,
    launcher_only: bool = False, peek: bool = False, **sections: dict[str, Any]
) -> Config:
    """`load_config(path)`; an unusable file ends the command: `stockade COMMAND: <error>`,
    exit 2 (the same for every command, so scripts and systemd can rely on it).

    Command-line overrides win over the file where given: `rules_dir`, and per section
    (`broker={"listen": args.listen}`); an unset flag (None, empty) keeps the file's value.
    `launcher_only`: a `configfile.LauncherFile` instead (top-level keys, `events` and
    `launcher` checked, the other sections unread), for commands that read nothing else;
    `peek`: `configpeek.load`, fewer keys still and no pydantic (`sandbox list|kill`)."""
    from stockade.yamlfile import ConfigError

    try:
        cfg = _load(path, peek=peek, launcher_only=launcher_only)
    except ConfigError as e:
        raise CommandFailed(f"stockade {command}: {e}", 2) from None
    updates: dict[str, Any] = {}
    if rules_dir:
        updates["rules_dir"] = rules_dir
    for name, keys in sections.items():
        given = {k: v for k, v in keys.items() if v}
        if given:
            updates[name] = getattr(cfg, name).model_copy(update=given)
    return cfg.model_copy(update=updates) if updates else cfg


def _load(path: str | None, *, peek: bool, launcher_only: bool) -> Any:
    if peek:
        from stockade.configpeek import load

        found = load(path)
        if found is not None:
            return found  # else the models decide this file, as for launcher_only
    if peek or launcher_only:
        from stockade.configfile import LauncherFile, load_as

        return load_as(LauncherFile, path)
    from stockade.config import load_config

    return load_config(path)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (None: every command, as `--help` and the docs need)."""
    parser = argparse.ArgumentParser(
        prog="stockade",
        description="Contain code written by AI agents: egress gateway, credential broker, "
        "sandbox launcher.",
    )
    parser.add_argument("--version", action="version", version="stockade 0.1.0")
    # handed to every command: component CLIs load stockade.yaml through it, so they need
    # not import this module (the top floor) to refuse an unusable file the same way
    parser.set_defaults(config_loader=config_or_fail)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in modules_for(argv):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue  # component not installed in this build
        module.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # a group without its subcommand: show that group's help
        (getattr(args, "group_parser", None) or parser).print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except CommandFailed as e:
        print(e.message, file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `stockade ... | head`: the reader left; exit quietly like other Unix tools
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
