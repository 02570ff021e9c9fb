"""The shell of `stockade rules usage`: find and read the event files, run the pure
core (policy/usage.py), print; its options here, its parser with the others (policy/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from . import eventlog

USAGE_SUMMARY = "per profile and entry: hits, tasks, bytes, last use; stale entries"
USAGE_DESCRIPTION = (
    "Read the events file and its rotations (events.jsonl, .1, .2 ...) and report, per "
    "profile and entry (and broker grant): hits, distinct tasks, bytes, last use, owner, "
    "the names a wildcard entry served and denials near the entry. Status: unused in the "
    "window, expired or expiring, past review_by. Exit 0; with --fail-on-stale 1 when an "
    "entry is unused, expired or overdue for review; 2 when the rules or the events "
    "cannot be read."
)


def add_usage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rules", default="rules", metavar="DIR",
                   help="rules directory (default ./rules)")  # fmt: skip
    p.add_argument("--events", metavar="FILE",
                   help="events file (default: events.file of stockade.yaml); its "
                   "rotations FILE.1, FILE.2 ... are read too")  # fmt: skip
    p.add_argument("--config", help="stockade.yaml (for the events file location)")
    p.add_argument("--since", default="90d", metavar="AGE",
                   help="count events of this recent period (e.g. 90d, 12h; default 90d; "
                   "'all': every event)")  # fmt: skip
    p.add_argument("--expiring-within", type=int, default=14, metavar="DAYS",
                   help="flag entries that expire within DAYS (default 14)")
    p.add_argument("--fail-on-stale", action="store_true",
                   help="exit 1 when an entry is unused, expired or overdue for review")


def _since(text: str, now: float) -> float | None:
    from stockade.events.view import parse_duration

    return None if text == "all" else now - parse_duration(text)


def _events_path(args: argparse.Namespace) -> Path:
    if args.events:
        return Path(args.events)
    return Path(args.config_loader(args.config, "rules usage").events_file)


def cmd_usage(args: argparse.Namespace) -> int:
    from .cli import _load_or_report
    from .usage import usage
    from .usage_out import report_json, report_table

    now = time.time()
    try:
        since = _since(args.since, now)
    except ValueError as e:
        print(f"stockade rules usage: --since: {e}", file=sys.stderr)
        return 2
    rs = _load_or_report(args.rules)
    if rs is None:
        return 2
    path = _events_path(args)
    files = eventlog.event_files(path)
    if not files:
        print(f"stockade rules usage: no events file at {path} (nor rotations of it)",
              file=sys.stderr)  # fmt: skip
        return 2
    stats = eventlog.ReadStats()
    today = args.today or datetime.fromtimestamp(now, UTC).date()
    try:
        report = usage(rs, eventlog.read_files(files, stats), now, since, today,
                       args.expiring_within)  # fmt: skip
    except OSError as e:
        print(f"stockade rules usage: cannot read events: {e}", file=sys.stderr)
        return 2
    for name, n in stats.bad_lines.items():
        print(f"{name}: {n} line(s) are not events; skipped", file=sys.stderr)
    if args.json:
        print(json.dumps(report_json(report, stats.files, stats.bad_lines), indent=2))
    else:
        print("\n".join(report_table(report)))
        print(f"{report.events} event(s) in the window from {len(files)} file(s); "
              f"{len(report.stale)} stale entr{'y' if len(report.stale) == 1 else 'ies'}",
              file=sys.stderr)  # fmt: skip
    return 1 if args.fail_on_stale and report.stale else 0
