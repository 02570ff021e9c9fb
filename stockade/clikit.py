"""The arguments and the log set-up every service command shares (`--config`,
`--log-level`), so `gateway serve`, `broker serve`, `launcher serve` and `up` spell them
the same way. Ground floor: component CLIs use it without importing `stockade.cli`.
"""

from __future__ import annotations

import argparse
import sys

BUILT_IN = "stockade.yaml (default: built-in)"
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_config_args(
    parser: argparse.ArgumentParser,
    *,
    help_text: str = BUILT_IN,
    short: bool = True,
    log_level: bool = False,
) -> None:
    """`--config` (with `short`: also `-c`, shown as FILE); with `log_level`, `--log-level`
    right after it (`add_log_level` when other options stand between them)."""
    flags = ("--config", "-c") if short else ("--config",)
    parser.add_argument(*flags, metavar="FILE" if short else None, help=help_text)
    if log_level:
        add_log_level(parser)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=LOG_LEVELS,
        help="diagnostic log level on stderr (events go to the events file)",
    )


def setup_logging(level: int | str) -> None:
    """Diagnostics on stderr, one line each (the events go to the events file)."""
    import logging  # here: the short commands (`sandbox kill`) log nothing

    logging.basicConfig(level=level, stream=sys.stderr, format=LOG_FORMAT)
