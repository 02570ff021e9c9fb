"""`stockade events`: a live, readable view of the event stream (`--json` for scripts),
counts by reason (`--summary`), and `stockade events verify` for the hash chain."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .view import EventFilter, count_events, counts_json, format_counts, format_line, parse_when

VERIFY_MODULE = "stockade.events.verify"


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "events",
        help="show the event stream (decisions, denials, lifecycle)",
        description="Show Stockade's event stream. Reads the JSON-lines events file "
        "(events.file in stockade.yaml, default <log_dir>/events.jsonl). Times are local "
        "with their zone (--utc for UTC). Repeat --action or --reason, or separate values with "
        "commas, to match any of them; every --label must match.",
    )
    p.add_argument("--config", help="stockade.yaml (for the events file location)")
    p.add_argument("--file", help="events file to read (overrides the config)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--task", help="only this task id")
    p.add_argument("--outcome", choices=("denied", "allowed"), help="only this decision")
    p.add_argument("--component", choices=("gateway", "dns", "broker", "launcher", "rules"))
    p.add_argument("--action", action="append", metavar="ACTION",
                   help="only these event.action values (e.g. dns_decision,broker_call)")
    p.add_argument("--reason", action="append", metavar="REASON",
                   help="only these event.reason values (e.g. no_matching_rule)")
    p.add_argument("--label", action="append", metavar="K=V",
                   help="only events whose labels.K is V (e.g. profile=pypi-build); all must match")
    when = "a duration back from now (30s, 5m, 2h, 1d) or an ISO date or time " \
        "(2026-12-01, 2026-12-01T19:00, 19:00; local unless it ends in Z or +hh:mm)"
    p.add_argument("--since", help=f"only events at or after this: {when}")
    p.add_argument("--until", help=f"only events at or before this: {when}")
    p.add_argument("--summary", action="store_true",
                   help="print counts by action, decision and reason instead of events "
                   "(event_summary counts go to the action they stand for)")
    p.add_argument("--utc", action="store_true", help="print times in UTC (…Z)")
    p.add_argument("--json", action="store_true",
                   help="pass events through as JSON lines (with --summary: one JSON object)")
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour the decision word (auto: on a terminal unless NO_COLOR is set)",
    )
    p.set_defaults(func=run)
    cmds = p.add_subparsers(dest="events_cmd", metavar="SUBCOMMAND")
    _add_verify(cmds)


def _add_verify(cmds: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    help_text = "check the events' hash chain: the first gap, reorder, edit or truncation"
    description = "Check the events' hash chain: the first gap, reorder, edit or truncation."
    if importlib.util.find_spec(VERIFY_MODULE) is None:
        # this build has no chain verifier: take any arguments (a NUL prefix character,
        # which no argument starts with, makes every one a plain word) and say so, rather
        # than failing on the first one as if it were a typo
        v = cmds.add_parser("verify", help=help_text, description=description,
                            prefix_chars="\0", add_help=False)
        v.add_argument("args", nargs="*", help="(not available in this build)")
        v.set_defaults(func=_verify_missing)
        return
    v = cmds.add_parser("verify", help=help_text, description=description)
    verify = importlib.import_module(VERIFY_MODULE)
    verify.add_arguments(v)
    v.set_defaults(func=verify.run)


def _verify_missing(args: argparse.Namespace) -> int:
    print("stockade events verify: not available in this build "
          f"({VERIFY_MODULE} is not installed)", file=sys.stderr)
    return 2


def _values(flag: str, given: list[str] | None) -> frozenset[str] | None:
    """Repeated and comma-separated values; None when the flag was not given."""
    if not given:
        return None
    out = frozenset(v.strip() for g in given for v in g.split(",") if v.strip())
    if not out:
        raise ValueError(f"{flag}: no value in {given[0]!r} (e.g. {flag} a,b or {flag} a)")
    return out


def _labels(given: list[str] | None) -> tuple[tuple[str, str], ...]:
    out = []
    for item in given or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"invalid --label {item!r} (use KEY=VALUE, e.g. profile=pypi-build)")
        out.append((key.strip(), value))
    return tuple(out)


def _when(flag: str, text: str | None, now: float) -> float | None:
    if text is None:
        return None
    try:
        return parse_when(text, now)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _filter(args: argparse.Namespace) -> EventFilter:
    now = time.time()
    since, until = _when("--since", args.since, now), _when("--until", args.until, now)
    if since is not None and until is not None and since > until:
        raise ValueError(f"--since {args.since} is after --until {args.until}: nothing matches")
    return EventFilter(
        task=args.task,
        outcome=args.outcome,
        component=args.component,
        since=since,
        until=until,
        actions=_values("--action", args.action),
        reasons=_values("--reason", args.reason),
        labels=_labels(args.label),
    )


def _events(path: Path, follow: bool, keep: EventFilter) -> Iterator[tuple[str, dict[str, Any]]]:
    from .follow import lines

    for line in lines(path, follow):
        try:
            ev: Any = json.loads(line)
        except json.JSONDecodeError:
            continue  # not an event (a torn or foreign line): the view goes on
        if isinstance(ev, dict) and keep(ev):
            yield line, ev


def run(args: argparse.Namespace) -> int:
    path = Path(args.file) if args.file else args.config_loader(args.config, "events").events_file
    try:
        keep = _filter(args)
    except ValueError as e:
        print(f"stockade events: {e}", file=sys.stderr)
        return 2
    if args.summary and args.follow:
        print("stockade events: --summary counts a file; it cannot --follow", file=sys.stderr)
        return 2
    if not path.exists() and not args.follow:
        print(f"stockade events: no events file at {path}", file=sys.stderr)
        return 1
    try:
        if args.summary:
            _print_summary(_events(path, False, keep), args.json)
        else:
            _print_events(_events(path, args.follow, keep), args)
    except BrokenPipeError:
        return 0
    except OSError as e:  # a directory, no read permission, an I/O error
        print(f"stockade events: cannot read {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def _print_events(events: Iterator[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    colour = args.color == "always" or (
        args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    )
    for line, ev in events:
        sys.stdout.write(line if args.json else format_line(ev, colour, args.utc) + "\n")
        sys.stdout.flush()


def _print_summary(events: Iterator[tuple[str, dict[str, Any]]], as_json: bool) -> None:
    rows = count_events(ev for _, ev in events)
    if as_json:
        print(json.dumps(counts_json(rows), separators=(",", ":")))
    else:
        print("\n".join(format_counts(rows)))
