"""`stockade rules learn -- CMD`: run the task (once, or --runs times) in a report-mode
profile with `stockade run`, and hand the task ids to the learning core.

`stockade run` composes the components (top floor); the rule model must not import it,
so it runs as a child process (`python -m stockade run --json`), as a user would run it.
Report mode is a profile's setting in the rules the gateway holds: a profile that
enforces them runs against a temporary copy of the rules with it switched to report mode
(policy/learn_copy.py; `stockade run --rules COPY` starts its stack on the copy), else
its denials would hide what the task needs. Only when that copy cannot be made is the
profile refused.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
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
    is said on stderr (exit 2): no profile, an enforcing one whose report-mode copy could
    not be made, a run that did not start."""
    if not args.profile or args.task:
        print(f"{PREFIX}: -- CMD needs --profile (the profile to run it in) and no --task",
              file=sys.stderr)  # fmt: skip
        return None
    runs = 1 if args.runs is None else args.runs
    if runs < 1:
        print(f"{PREFIX}: --runs must be at least 1", file=sys.stderr)
        return None
    found = _rules_in_report_mode(args)
    if found is None:
        return None
    rules, copied = found
    try:
        return _run_all(args, cmd, runs, rules if copied else None)
    finally:
        if copied:
            from .learn_copy import remove_copy

            remove_copy(rules)


def _run_all(args: argparse.Namespace, cmd: list[str], runs: int,
             rules: Path | None) -> list[str] | None:
    tasks = []
    for i in range(runs):
        result = _run_once(args, cmd, rules)
        if result is None:
            return None
        tasks.append(result["task_id"])
        ended = f"ended by {result.get('ended_by')}, exit {result.get('exit_code')}"
        print(f"{PREFIX}: run {i + 1} of {runs}: task {tasks[-1]} {ended}",
              file=sys.stderr)  # fmt: skip
    return tasks


def _rules_in_report_mode(args: argparse.Namespace) -> tuple[Path, bool] | None:
    """The rules to run --profile with: the configured ones when the profile is in report
    mode there, else a temporary copy with it switched to report mode (True: a copy, the
    caller removes it); None once the reason is said on stderr."""
    from .cli import _load_or_report
    from .learn_copy import CopyError, report_mode_copy
    from .suggest import did_you_mean

    rules_dir = args.config_loader(args.config, "rules learn").rules_dir
    rs = _load_or_report(rules_dir)
    if rs is None:
        return None
    profile = rs.profiles.get(args.profile)
    if profile is None:
        print(f"{PREFIX}: unknown profile {args.profile!r} in {rules_dir}"
              f"{did_you_mean(args.profile, rs.profiles)}", file=sys.stderr)  # fmt: skip
        return None
    if profile.mode == "report":
        return Path(rules_dir), False
    try:
        copy = report_mode_copy(rules_dir, profile)
    except (CopyError, OSError) as e:
        print(f"{PREFIX}: profile {args.profile!r} enforces its rules, and a report-mode "
              f"copy of them could not be made ({e}): what the task needs beyond them "
              "would be denied, not learnt", file=sys.stderr)  # fmt: skip
        return None
    print(f"{PREFIX}: profile {args.profile!r} enforces its rules: the task runs in report "
          f"mode against a temporary copy of {rules_dir} (your files are not changed)",
          file=sys.stderr)  # fmt: skip
    return copy, True


def _run_once(args: argparse.Namespace, cmd: list[str],
              rules: Path | None) -> dict[str, Any] | None:
    argv = [sys.executable, "-m", "stockade", "run", "--profile", args.profile, "--json"]
    if args.config:
        argv += ["--config", args.config]
    if rules is not None:
        argv += ["--rules", str(rules)]
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
