"""The shell of `stockade rules usage`: find and read the event files, run the pure
core (policy/usage.py), print; its options here, its parser with the others (policy/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, TypeVar

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
    "--task (or every task of --profile; or of the tasks it runs itself: --profile P "
    "[--runs N] -- CMD runs CMD with stockade run in P; an enforcing P runs in report "
    "mode against a temporary copy of the rules, the rule files are never changed) "
    "and print a profile that would have allowed what "
    "they did: exact names and ports, methods and path globs of inspected requests, broker "
    "operations, each with 'reason: TODO' and its evidence. Across several tasks only what "
    "at least --min-share of them needed is kept. Record the tasks in report mode (egress: "
    "mode: report) so nothing they need is denied. Exit 0; 2 when no events of the tasks "
    "are found or the input cannot be read."
)


REPLAY_SUMMARY = "what a candidate rule set would have done to recorded traffic"
REPLAY_DESCRIPTION = (
    "Decide every recorded rule decision (connections, requests, DNS, broker calls; the "
    "events file and its rotations) again under the candidate rules and print the flows "
    "newly allowed and newly denied, by entry. Report mode counts as the rules' verdict "
    "(denied), not the outcome. Exit 0; with --fail-on-new-allow 1 when any flow is newly "
    "allowed; 2 when the rules or the events cannot be read."
)


def add_replay_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("rules", metavar="CANDIDATE_DIR", help="the candidate rules directory")
    _add_events_options(p)
    p.add_argument("--since", default="all", metavar="AGE",
                   help="replay events of this recent period only (e.g. 30d; default all)")
    p.add_argument("--markdown", action="store_true",
                   help="a Markdown report to paste into a merge request")
    p.add_argument("--fail-on-new-allow", action="store_true",
                   help="exit 1 when the candidate allows a flow the recorded rules did not")


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay import replay
    from .replay_out import replay_json, replay_markdown, replay_text

    got = _inputs(args, "rules replay")
    if got is None:
        return 2
    rs, stats = got.rules, got.stats
    recorded = (e for e in eventlog.read_files(got.files, stats)
                if got.since is None or (eventlog.when(e) or 0) >= got.since)  # fmt: skip
    report = _computed("rules replay", stats, lambda: replay(rs, recorded, got.today))
    if report is None:
        return 2
    if args.json:
        print(json.dumps(replay_json(report, rs.version, stats.files), indent=2))
    elif args.markdown:
        sys.stdout.write(replay_markdown(report, rs.version))
    else:
        print("\n".join(replay_text(report, rs.version)))
    return 1 if args.fail_on_new_allow and report.newly(True) else 0


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
    from .learn_run import add_run_options

    add_run_options(p)


def cmd_learn(args: argparse.Namespace) -> int:
    from .learn import observe, propose
    from .learn_out import proposal_json, proposal_yaml
    from .learn_run import command, run_tasks

    cmd = command(args)
    if cmd is None:
        return 2
    if cmd:
        ran = run_tasks(args, cmd)
        if ran is None:
            return 2
        args.task = ran
    if not args.task and not args.profile:
        print("stockade rules learn: name the tasks (--task ID) or a --profile", file=sys.stderr)
        return 2
    events = _open_events(args, "rules learn")
    if events is None:
        return 2
    files, stats = events
    tasks = set(args.task) if args.task else None
    obs = _computed("rules learn", stats, lambda: observe(
        eventlog.read_files(files, stats), tasks, args.profile))  # fmt: skip
    if obs is None:
        return 2
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


_T = TypeVar("_T")
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


def _computed(command: str, stats: eventlog.ReadStats, compute: Callable[[], _T]) -> _T | None:
    """`compute()` (which reads the event files), then the lines it skipped, on stderr;
    None when a file could not be read (said on stderr too)."""
    try:
        out = compute()
    except OSError as e:
        print(f"stockade {command}: cannot read events: {e}", file=sys.stderr)
        return None
    for name, n in stats.bad_lines.items():
        print(f"{name}: {n} line(s) are not events; skipped", file=sys.stderr)
    return out


def _since(text: str, now: float) -> float | None:
    from stockade.events.view import parse_duration

    return None if text == "all" else now - parse_duration(text)


@dataclass
class _Inputs:
    """What `usage` and `replay` read before they start: the rules and the event files."""

    now: float
    since: float | None  # epoch seconds; None: every event
    today: date
    rules: Any
    files: list[Path]
    stats: eventlog.ReadStats


def _inputs(args: argparse.Namespace, command: str) -> _Inputs | None:
    """The command's inputs, or None once the reason is said on stderr (exit 2)."""
    from .cli import _load_or_report

    now = time.time()
    try:
        since = _since(args.since, now)
    except ValueError as e:
        print(f"stockade {command}: --since: {e}", file=sys.stderr)
        return None
    rs = _load_or_report(args.rules)
    opened = None if rs is None else _open_events(args, command)
    if opened is None:
        return None
    today = args.today or datetime.fromtimestamp(now, UTC).date()
    return _Inputs(now, since, today, rs, *opened)


def _events_path(args: argparse.Namespace, command: str) -> Path:
    if args.events:
        return Path(args.events)
    return Path(args.config_loader(args.config, command).events_file)


def cmd_usage(args: argparse.Namespace) -> int:
    from .usage import usage
    from .usage_out import report_json, report_table

    got = _inputs(args, "rules usage")
    if got is None:
        return 2
    files, stats = got.files, got.stats
    report = _computed("rules usage", stats, lambda: usage(
        got.rules, eventlog.read_files(files, stats), got.now, got.since, got.today,
        args.expiring_within))  # fmt: skip
    if report is None:
        return 2
    if args.json:
        print(json.dumps(report_json(report, stats.files, stats.bad_lines), indent=2))
    else:
        print("\n".join(report_table(report)))
        print(f"{report.events} event(s) in the window from {len(files)} file(s); "
              f"{len(report.stale)} stale entr{'y' if len(report.stale) == 1 else 'ies'}",
              file=sys.stderr)  # fmt: skip
    return 1 if args.fail_on_stale and report.stale else 0
