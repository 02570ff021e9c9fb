"""`stockade events`: a live, readable view of the event stream (`--json` for scripts)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "events",
        help="show the event stream (decisions, denials, lifecycle)",
        description="Show Stockade's event stream. Reads the JSON-lines events file "
        "(events.file in stockade.yaml, default <log_dir>/events.jsonl).",
    )
    p.add_argument("--config", help="stockade.yaml (for the events file location)")
    p.add_argument("--file", help="events file to read (overrides the config)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--task", help="only this task id")
    p.add_argument("--outcome", choices=("denied", "allowed"), help="only this decision")
    p.add_argument("--component", choices=("gateway", "dns", "broker", "launcher", "rules"))
    p.add_argument("--since", help="only events newer than this (e.g. 30s, 5m, 2h, 1d)")
    p.add_argument("--json", action="store_true", help="pass events through as JSON lines")
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour the decision word (auto: on a terminal unless NO_COLOR is set)",
    )
    p.set_defaults(func=run)


def _lines(path: Path, follow: bool, poll: float = 0.25) -> Iterator[str]:
    """Whole lines of `path`; with follow, keeps reading across rotation (inode change)."""
    fh = None
    inode = None
    buf = ""
    while True:
        if fh is None:
            try:
                fh = open(path, encoding="utf-8")  # noqa: SIM115 - kept open while following
                inode = os.fstat(fh.fileno()).st_ino
            except FileNotFoundError:
                if not follow:
                    return
                time.sleep(poll)
                continue
        chunk = fh.readline()
        if chunk:
            buf += chunk
            if buf.endswith("\n"):
                yield buf
                buf = ""
            continue
        if not follow:
            fh.close()
            return
        time.sleep(poll)  # at end of file: wait for more, or for a rotation
        try:
            rotated = os.stat(path).st_ino != inode
        except FileNotFoundError:
            rotated = False
        if rotated:
            fh.close()
            fh = None


def run(args: argparse.Namespace) -> int:
    from .view import EventFilter, format_line, parse_duration

    path = Path(args.file) if args.file else args.config_loader(args.config, "events").events_file
    try:
        since = time.time() - parse_duration(args.since) if args.since else None
    except ValueError as e:
        print(f"stockade events: {e}", file=sys.stderr)
        return 2
    if not path.exists() and not args.follow:
        print(f"stockade events: no events file at {path}", file=sys.stderr)
        return 1
    keep = EventFilter(task=args.task, outcome=args.outcome, since=since, component=args.component)
    colour = args.color == "always" or (
        args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    )
    try:
        for line in _lines(path, args.follow):
            try:
                ev: Any = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(ev, dict) or not keep(ev):
                continue
            if args.json:
                sys.stdout.write(line)
            else:
                sys.stdout.write(format_line(ev, colour) + "\n")
            sys.stdout.flush()
    except BrokenPipeError:
        return 0
    return 0
