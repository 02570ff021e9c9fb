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
    _add_events_options(p)
    p.add_argument("--since", default="90d", metavar="AGE",
                   help="count events of this recent period (e.g. 90d, 12h; default 90d; "
                   "'all': every event)")  # fmt: skip
    p.add_argument("--expiring-within", type=int, default=14, metavar="DAYS",
                   help="flag entries that expire within DAYS (default 14)")
    p.add_argument("--fail-on-stale", action="store_true",
                   help="exit 1 when an entry is unused, expired or overdue for review")


LEARN_SUMMARY = "propose the smallest profile that allows what recorded tasks did"
LEARN_DESCRIPTION = (
    "Read recorded events (the events file and its rotations) of the tasks named by "
    "--task (or every task of --profile) and print a profile that would have allowed what "
    "they did: exact names and ports, methods and path globs of inspected requests, broker "
    "operations, each with 'reason: TODO' and its evidence. Across several tasks only what "
    "at least --min-share of them needed is kept. Record the tasks in report mode (egress: "
    "mode: report) so nothing they need is denied. Exit 0; 2 when no events of the tasks "
    "are found or the input cannot be read."
)


def _min_share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"not a share in (0, 1]: {text!r}")
    return v


def _add_events_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", metavar="FILE",
                   help="events file (default: events.file of stockade.yaml); its "
                   "rotations FILE.1, FILE.2 ... are read too")  # fmt: skip
    p.add_argument("--config", help="stockade.yaml (for the events file location)")


def add_learn_options(p: argparse.ArgumentParser) -> None:
    _add_events_options(p)
    p.add_argument("--task", action="append", metavar="ID",
                   help="a recorded task to learn from (repeat for several runs)")
    p.add_argument("--profile", metavar="NAME",
                   help="learn from every recorded task of this profile")
    p.add_argument("--min-share", type=_min_share, default=1.0, metavar="X",
                   help="keep what at least this share of the tasks needed (default 1: all)")
    p.add_argument("--name", metavar="NAME",
                   help="the proposed profile's name (default: --profile, else 'learned')")


def cmd_learn(args: argparse.Namespace) -> int:
    from .learn import observe, propose
    from .learn_out import proposal_json, proposal_yaml

    if not args.task and not args.profile:
        print("stockade rules learn: name the tasks (--task ID) or a --profile", file=sys.stderr)
        return 2
    events = _open_events(args, "rules learn")
    if events is None:
        return 2
    files, stats = events
    try:
        obs = observe(eventlog.read_files(files, stats),
                      set(args.task) if args.task else None, args.profile)  # fmt: skip
    except OSError as e:
        print(f"stockade rules learn: cannot read events: {e}", file=sys.stderr)
        return 2
    _report_bad_lines(stats)
    if not obs.tasks:
        print(f"stockade rules learn: no decisions of those tasks in {len(files)} file(s)",
              file=sys.stderr)  # fmt: skip
        return 2
    proposal = propose(obs, args.min_share)
    name = args.name or args.profile or "learned"
    if args.json:
        print(json.dumps(proposal_json(proposal, name), indent=2))
    else:
        sys.stdout.write(proposal_yaml(proposal, name))
    return 0


_Opened = tuple[list[Path], eventlog.ReadStats]


def _open_events(args: argparse.Namespace, command: str) -> _Opened | None:
    """The event files to read (the file and its rotations), or None, said on stderr."""
    path = _events_path(args, command)
    files = eventlog.event_files(path)
    if not files:
        print(f"stockade {command}: no events file at {path} (nor rotations of it)",
              file=sys.stderr)  # fmt: skip
        return None
    return files, eventlog.ReadStats()


def _report_bad_lines(stats: eventlog.ReadStats) -> None:
    for name, n in stats.bad_lines.items():
        print(f"{name}: {n} line(s) are not events; skipped", file=sys.stderr)


def _since(text: str, now: float) -> float | None:
    from stockade.events.view import parse_duration

    return None if text == "all" else now - parse_duration(text)


def _events_path(args: argparse.Namespace, command: str) -> Path:
    if args.events:
        return Path(args.events)
    return Path(args.config_loader(args.config, command).events_file)


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
    events = _open_events(args, "rules usage")
    if events is None:
        return 2
    files, stats = events
    today = args.today or datetime.fromtimestamp(now, UTC).date()
    try:
        report = usage(rs, eventlog.read_files(files, stats), now, since, today,
                       args.expiring_within)  # fmt: skip
    except OSError as e:
        print(f"stockade rules usage: cannot read events: {e}", file=sys.stderr)
        return 2
    _report_bad_lines(stats)
    if args.json:
        print(json.dumps(report_json(report, stats.files, stats.bad_lines), indent=2))
    else:
        print("\n".join(report_table(report)))
        print(f"{report.events} event(s) in the window from {len(files)} file(s); "
              f"{len(report.stale)} stale entr{'y' if len(report.stale) == 1 else 'ies'}",
              file=sys.stderr)  # fmt: skip
    return 1 if args.fail_on_stale and report.stale else 0
