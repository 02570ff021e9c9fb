"""`stockade rules learn -- CMD`: run the task (once, or --runs times) in a report-mode
profile with `stockade run`, and hand the task ids to the learning core.

`stockade run` composes the components (top floor); the rule model must not import it,
so it runs as a child process (`python -m stockade run --json`), as a user would run it.
Report mode is a profile's setting in the rules the gateway holds, so the profile must
be one of the configured rules and in report mode: an enforcing profile would deny what
the task needs and learn would propose too little.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

PREFIX = "stockade rules learn"


def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, metavar="N",
                   help="with -- CMD: run the task N times (default 1); --min-share "
                   "applies across the runs")  # fmt: skip
    p.add_argument("--input", action="append", metavar="HOST_PATH[:GUEST_PATH]",
                   help="with -- CMD: as stockade run --input (repeatable)")  # fmt: skip
    p.add_argument("cmd", nargs=argparse.REMAINDER,
                   help="-- CMD [ARGS...]: run this task in --profile (report mode) and "
                   "learn from its events")  # fmt: skip


def command(args: argparse.Namespace) -> list[str] | None:
    """The command to run ([] when there is none), or None once a misuse is said on
    stderr: `--` with nothing after it, or the run options without a command."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
        if not cmd:
            print(f"{PREFIX}: missing command after --", file=sys.stderr)
            return None
    if not cmd and (args.runs is not None or args.input):
        print(f"{PREFIX}: --runs and --input are for a task learn runs (-- CMD)",
              file=sys.stderr)  # fmt: skip
        return None
    return cmd


def run_tasks(args: argparse.Namespace, cmd: list[str]) -> list[str] | None:
    """The task ids of `args.runs` runs of `cmd` in `args.profile`, or None once the reason
    is said on stderr (exit 2): no or an enforcing profile, a run that did not start."""
    if not args.profile or args.task:
        print(f"{PREFIX}: -- CMD needs --profile (a report-mode profile to run it in) and "
              "no --task", file=sys.stderr)  # fmt: skip
        return None
    runs = 1 if args.runs is None else args.runs
    if runs < 1:
        print(f"{PREFIX}: --runs must be at least 1", file=sys.stderr)
        return None
    if not _report_mode(args):
        return None
    tasks = []
    for i in range(runs):
        result = _run_once(args, cmd)
        if result is None:
            return None
        tasks.append(result["task_id"])
        ended = f"ended by {result.get('ended_by')}, exit {result.get('exit_code')}"
        print(f"{PREFIX}: run {i + 1} of {runs}: task {tasks[-1]} {ended}",
              file=sys.stderr)  # fmt: skip
    return tasks


def _report_mode(args: argparse.Namespace) -> bool:
    """Is --profile a report-mode profile of the configured rules? (said on stderr if not)"""
    from .cli import _load_or_report
    from .suggest import did_you_mean

    rules_dir = args.config_loader(args.config, "rules learn").rules_dir
    rs = _load_or_report(rules_dir)
    if rs is None:
        return False
    profile = rs.profiles.get(args.profile)
    if profile is None:
        print(f"{PREFIX}: unknown profile {args.profile!r} in {rules_dir}"
              f"{did_you_mean(args.profile, rs.profiles)}", file=sys.stderr)  # fmt: skip
        return False
    if profile.mode != "report":
        print(f"{PREFIX}: profile {args.profile!r} enforces its rules, so what the task needs "
              "beyond them would be denied, not learnt; run it in a profile with "
              "'egress: {mode: report}' (docs/review.md)", file=sys.stderr)  # fmt: skip
        return False
    return True


def _run_once(args: argparse.Namespace, cmd: list[str]) -> dict[str, Any] | None:
    argv = [sys.executable, "-m", "stockade", "run", "--profile", args.profile, "--json"]
    if args.config:
        argv += ["--config", args.config]
    for spec in args.input or ():
        argv += ["--input", spec]
    proc = subprocess.run([*argv, "--", *cmd], capture_output=True, text=True, check=False)
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        result = None
    if not isinstance(result, dict) or not result.get("task_id"):
        tail = proc.stderr.strip().splitlines()[-5:]
        print(f"{PREFIX}: the task did not run (stockade run exit {proc.returncode})"
              + "".join(f"\n  {line}" for line in tail), file=sys.stderr)  # fmt: skip
        return None
    return result
