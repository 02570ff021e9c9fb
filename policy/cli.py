"""`stockade rules lint|explain|test|diff`: the security team's tools for rule files.

Human-readable output by default, `--json` for scripts. Exit codes: 0 ok, 1 problems
(lint errors, failed tests, a denied explain), 2 unusable input (bad rules dir, usage).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any


def _date(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {text!r}") from None


_Parents = list[argparse.ArgumentParser]  # the options every subcommand takes


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    group = sub.add_parser(
        "rules",
        help="check, explain, test and compare rule files",
        description="Tools for the rule files in rules/ (profiles, presets, apis, tests).",
    )
    group.set_defaults(group_parser=group)
    rsub = group.add_subparsers(dest="rules_command", metavar="SUBCOMMAND")

    today = argparse.ArgumentParser(add_help=False)
    today.add_argument("--today", type=_date, metavar="YYYY-MM-DD",
                       help="evaluate expiry as of this date (default: today, UTC)")  # fmt: skip
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="machine-readable output")
    parents = [today, as_json]
    _add_lint(rsub, parents)
    _add_explain(rsub, parents)
    _add_test(rsub, parents)
    _add_diff(rsub, parents)
    _add_usage(rsub, parents)
    _add_learn(rsub, parents)
    _add_replay(rsub, parents)
    _add_editor(rsub)


def _subcommand(
    rsub: argparse._SubParsersAction,  # type: ignore[type-arg]
    parents: _Parents,
    name: str,
    func: Callable[[argparse.Namespace], int],
    summary: str,
    description: str,
) -> argparse.ArgumentParser:
    """One `rules` subcommand's parser (`summary`: its line in `rules --help`), run by
    `func`, with the shared --today/--json options."""
    parser: argparse.ArgumentParser = rsub.add_parser(
        name, parents=parents, help=summary, description=description
    )
    parser.set_defaults(func=func)
    return parser


def _add_paths(parser: argparse.ArgumentParser, paths_help: str) -> None:
    """PATH... and `--rules DIR` (the same thing): the rules a command reads."""
    parser.add_argument("paths", nargs="*", metavar="PATH", help=paths_help)
    parser.add_argument("--rules", metavar="DIR", help="rules directory (same as PATH)")


def _add_lint(rsub: argparse._SubParsersAction, parents: _Parents) -> None:  # type: ignore[type-arg]
    """`rules lint`: validate, then warn (see policy/lint.py)."""
    lint = _subcommand(
        rsub, parents, "lint", cmd_lint,
        "validate rule files; list errors and warnings",
        "Validate rule directories. Prints one 'file:line:col: message' line per "
        "problem. Exit 1 when there is an error; warnings (expired, soon expiring or "
        "shadowed entries, upload hosts without an http block, unused presets, report-mode "
        "profiles, uninspected entries on a shared front-end of rules/catalogues/) do not "
        "fail, nor do notes (an entry's accept_fronting).",
    )  # fmt: skip
    lint.add_argument("--strict", action="store_true",
                      help="an uninspected entry on a shared front-end without "
                      "'accept_fronting' is an error")  # fmt: skip
    _add_paths(lint, "rules directory (or a file inside one); default ./rules")
    lint.add_argument(
        "--expiring-within", type=int, default=14, metavar="DAYS",
        help="warn about entries that expire within DAYS (default 14; 0: off)",
    )  # fmt: skip


def _add_explain(rsub: argparse._SubParsersAction, parents: _Parents) -> None:  # type: ignore[type-arg]
    """`rules explain`: one request's verdict, the way the gateway decides it."""
    explain = _subcommand(
        rsub, parents, "explain", cmd_explain,
        "show the verdict for one request",
        "Decide one request the way the gateway would and show the verdict, rule "
        "id, reason code and the entry's reason. A URL target implies method GET and its "
        "path; a host:port target is a plain connection (no method/path) unless --method is "
        "given. Exit 0 when allowed, 1 when denied, 2 for an unknown profile or target.",
    )  # fmt: skip
    explain.add_argument("target", metavar="TARGET", help="URL or host:port")
    explain.add_argument("--profile", "-p", required=True, help="profile name")
    explain.add_argument("--method", "-X", help="HTTP method (default GET for URLs)")
    explain.add_argument("--dns", action="store_true",
                         help="TARGET is a DNS name: may the DNS firewall resolve it?")  # fmt: skip
    explain.add_argument("--rules", default="rules", metavar="DIR",
                         help="rules directory (default ./rules)")  # fmt: skip


def _add_test(rsub: argparse._SubParsersAction, parents: _Parents) -> None:  # type: ignore[type-arg]
    """`rules test`: run the policy tests of rules/tests/."""
    test = _subcommand(
        rsub, parents, "test", cmd_test,
        "run the policy tests in rules/tests/",
        "Run policy tests (rules/tests/*.yaml). Prints each failure and closes "
        "with 'N passed, N failed'. Exit 1 on any failure.",
    )  # fmt: skip
    _add_paths(test, "rules directory, its tests/ folder or one test file; default ./rules")
    test.add_argument("--verbose", "-v", action="store_true", help="print passing cases too")


def _add_diff(rsub: argparse._SubParsersAction, parents: _Parents) -> None:  # type: ignore[type-arg]
    """`rules diff`: what a change of rules opens and closes."""
    diff = _subcommand(
        rsub, parents, "diff", cmd_diff,
        "what a rule change opens and closes, per profile",
        "Compare two rules directories: per profile, what NEW allows that OLD "
        "did not, what it no longer allows, deny entries added/removed and changed settings "
        "(mode, isolation, limits, broker grants). Exit 0 (also when there are changes); "
        "with --exit-code 1 when any profile changed; 2 when a directory is invalid.",
    )  # fmt: skip
    diff.add_argument("old", metavar="OLD_DIR")
    diff.add_argument("new", metavar="NEW_DIR")
    diff.add_argument("--exit-code", action="store_true",
                      help="exit 1 when the rule sets differ in effect (as git diff --exit-code)")


def _add_usage(rsub: argparse._SubParsersAction, parents: _Parents) -> None:  # type: ignore[type-arg]
    """`rules usage`: the periodic review of what each entry did (policy/usage.py)."""
    from . import review_cli as r

    r.add_usage_options(_subcommand(rsub, parents, "usage", r.cmd_usage, r.USAGE_SUMMARY,
                                    r.USAGE_DESCRIPTION))  # fmt: skip


def _add_learn(rsub: argparse._SubParsersAction, parents: _Parents) -> None:  # type: ignore[type-arg]
    """`rules learn`: a first allowlist from what recorded tasks did (policy/learn.py)."""
    from . import review_cli as r

    r.add_learn_options(_subcommand(rsub, parents, "learn", r.cmd_learn, r.LEARN_SUMMARY,
                                    r.LEARN_DESCRIPTION))  # fmt: skip


def _add_replay(rsub: argparse._SubParsersAction, parents: _Parents) -> None:  # type: ignore[type-arg]
    """`rules replay`: recorded decisions against candidate rules (policy/replay.py)."""
    from . import review_cli as r

    r.add_replay_options(_subcommand(rsub, parents, "replay", r.cmd_replay, r.REPLAY_SUMMARY,
                                     r.REPLAY_DESCRIPTION))  # fmt: skip


def _add_editor(rsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`rules schema` and `rules fmt`: the editor's and the pipeline's (editor_cli.py)."""
    from . import editor_cli as ed

    ed.add_schema_options(_subcommand(rsub, [], "schema", ed.cmd_schema,
                                      ed.SCHEMA_SUMMARY, ed.SCHEMA_DESCRIPTION))  # fmt: skip
    ed.add_fmt_options(_subcommand(rsub, [], "fmt", ed.cmd_fmt, ed.FMT_SUMMARY,
                                   ed.FMT_DESCRIPTION))  # fmt: skip


def _resolve(path: Path) -> tuple[Path, Path | None]:
    """(rules dir, restrict-to path or None) for a PATH argument."""
    from .sources import KINDS

    if path.is_file():
        return path.parent.parent, path
    if path.is_dir() and path.name in KINDS and not any((path / k).is_dir() for k in KINDS):
        return path.parent, path
    return path, None


def _paths(args: argparse.Namespace) -> list[str]:
    paths = list(args.paths) + ([args.rules] if args.rules else [])
    return paths or ["rules"]


def _problem_json(p: Any) -> dict[str, Any]:
    return {"file": p.file, "line": p.line, "column": p.column, "message": p.message,
            "severity": p.severity}  # fmt: skip


def cmd_lint(args: argparse.Namespace) -> int:
    from .lint import lint_ruleset, missing_catalogue
    from .loader import load_rules
    from .problems import RulesError

    problems = []
    for raw in _paths(args):
        root, _ = _resolve(Path(raw))
        try:
            rs = load_rules(root)
        except RulesError as e:
            problems.extend(e.problems)
            continue
        problems.extend(lint_ruleset(rs, args.today, args.expiring_within, args.strict))
        empty = missing_catalogue(rs, str(root)) if args.strict else None
        if empty is not None:
            problems.append(empty)
    errors = sum(p.severity == "error" for p in problems)
    notes = sum(p.severity == "note" for p in problems)
    warnings = len(problems) - errors - notes
    if args.json:
        print(json.dumps({"errors": errors, "warnings": warnings, "notes": notes,
                          "problems": [_problem_json(p) for p in problems]}, indent=2))  # fmt: skip
    else:
        for p in problems:
            print(p)
        tail = f", {notes} note(s)" if notes else ""
        print(f"{errors} error(s), {warnings} warning(s){tail}", file=sys.stderr)
    return 1 if errors else 0


def _load_or_report(root: str | Path) -> Any:
    from .loader import load_rules
    from .problems import RulesError

    try:
        return load_rules(root)
    except RulesError as e:
        for p in e.problems:
            print(p, file=sys.stderr)
        print(f"{root}: rules are invalid (run 'stockade rules lint')", file=sys.stderr)
        return None


def _entry_by_id(profile: Any, rule_id: str | None) -> Any:
    if rule_id is None:
        return None
    for e in profile.allow + profile.deny:
        if e.id == rule_id:
            return e
    return None


def cmd_explain(args: argparse.Namespace) -> int:
    from .suggest import did_you_mean
    from .targets import TargetError, parse_target

    rs = _load_or_report(args.rules)
    if rs is None:
        return 2
    if args.profile not in rs.profiles:
        # a usage error, not a deny: exit 1 would read as "the rules refuse this"
        print(f"explain: unknown profile {args.profile!r}"
              f"{did_you_mean(args.profile, rs.profiles)}", file=sys.stderr)  # fmt: skip
        return 2
    try:
        facts = parse_target(args.target, args.method)
    except TargetError as e:
        print(f"explain: {e}", file=sys.stderr)
        return 2
    facts, v = _explain_decide(args, rs, facts)
    profile = rs.profiles.get(args.profile)
    entry = _entry_by_id(profile, v.rule_id) if profile else None
    out = _explanation(args, facts, v, profile, entry)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_explanation(out, v, profile, entry, args.dns)
    return 0 if v.allowed else 1


def _explain_decide(args: argparse.Namespace, rs: Any, facts: Any) -> tuple[Any, Any]:
    """(the facts decided on, the verdict): a DNS lookup of the target, or a connection."""
    if args.dns:
        from .decide import decide_name
        from .model import RequestFacts

        facts = RequestFacts(host=args.target, port=53)
        return facts, decide_name(rs, args.profile, args.target, today=args.today)
    from .decide import decide

    return facts, decide(rs, args.profile, facts, today=args.today)


def _explanation(
    args: argparse.Namespace, facts: Any, v: Any, profile: Any, entry: Any
) -> dict[str, Any]:
    """The `--json` document (the text output prints from it too)."""
    from .hosts import HostError, normalize_host

    try:
        host = normalize_host(facts.host) if facts.host is not None else None
    except HostError as e:
        host = f"(invalid: {e})"
    return {
        "kind": "dns" if args.dns else "connection",
        "profile": args.profile,
        "target": args.target,
        "host": host,
        "port": facts.port,
        "method": facts.method,
        "path": facts.path,
        "allowed": v.allowed,
        "verdict": "allow" if v.allowed else "deny",
        "reason": str(v.reason),
        "rule_id": v.rule_id,
        "entry_reason": v.entry_reason,
        "rule_location": str(entry.location) if entry and entry.location else None,
        "origin": entry.origin if entry else None,
        "report_only": v.report_only,
        "needs_inspection": v.needs_inspection,
        "policy_version": v.policy_version,
        # the profile's relaxations of the sandbox's seccomp filter (lint warns about them)
        "syscalls_allowed": sorted(profile.syscalls.allow) if profile and profile.syscalls
        else [],
    }


def _print_explanation(out: dict[str, Any], v: Any, profile: Any, entry: Any, dns: bool) -> None:
    verdict = out["verdict"] + (" (report mode: the rules deny this)" if v.report_only
                                else "")  # fmt: skip
    print(f"verdict:  {verdict}")
    print(f"reason:   {v.reason}")
    if v.rule_id:
        where = f"  ({out['rule_location']}, {out['origin']})" if entry else ""
        print(f"rule:     {v.rule_id}{where}")
        print(f"why:      {v.entry_reason}")
    else:
        print("rule:     (none)")
    host = out["host"]
    req = f"DNS lookup of {host}" if dns else f"{host} port {out['port']}"
    if out["method"] and not dns:
        req += f" {out['method']} {out['path']}"
    print(f"request:  {req}")
    if v.needs_inspection:
        print("note:     the entry is inspected (an http block or host_must_match_sni): "
              "the gateway decides each request of this flow (L7)")
    if profile and profile.syscalls:
        print(f"sandbox:  the seccomp filter lets {', '.join(out['syscalls_allowed'])} "
              f"through ({profile.syscalls.reason})")
    print(f"policy:   {v.policy_version}")


def cmd_test(args: argparse.Namespace) -> int:
    from .policytests import run_tests

    passed = failed = 0
    report: list[dict[str, Any]] = []
    for raw in _paths(args):
        root, only = _resolve(Path(raw))
        rs = _load_or_report(root)
        if rs is None:
            print(f"{raw}: cannot run tests on invalid rules", file=sys.stderr)
            failed += 1
            continue
        for r in run_tests(rs, _cases_under(rs.tests, only), args.today):
            c = r.case
            where = str(c.location) if c.location else "?"
            label = f"{c.profile} {c.method or ''} {c.target}".replace("  ", " ")
            if r.passed:
                passed += 1
                if args.verbose and not args.json:
                    print(f"{where}: ok: {label}")
            else:
                failed += 1
                if not args.json:
                    print(f"{where}: FAIL: {label}: {'; '.join(r.failures)}")
            report.append(_result_json(where, r))
    if args.json:
        print(json.dumps({"passed": passed, "failed": failed, "results": report}, indent=2))
    else:
        print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def _cases_under(cases: tuple[Any, ...], only: Path | None) -> tuple[Any, ...]:
    """The policy tests written in `only` (a file, or a folder of them); all without it."""
    if only is None:
        return cases
    target = only.resolve()
    return tuple(
        c for c in cases if c.location is not None
        and (Path(c.location.file).resolve() == target
             or target in Path(c.location.file).resolve().parents)
    )  # fmt: skip


def _result_json(where: str, r: Any) -> dict[str, Any]:
    c, v = r.case, r.verdict
    return {"location": where, "profile": c.profile, "target": c.target,
            "method": c.method, "expect": c.expect, "passed": r.passed,
            "failures": list(r.failures),
            "verdict": None if v is None else {
                "allowed": v.allowed, "reason": str(v.reason),
                "rule_id": v.rule_id, "report_only": v.report_only}}  # fmt: skip


def cmd_diff(args: argparse.Namespace) -> int:
    from .diff import diff_rulesets

    old = _load_or_report(args.old)
    new = _load_or_report(args.new)
    if old is None or new is None:
        return 2
    diffs = diff_rulesets(old, new, args.today)
    changed = 1 if args.exit_code and diffs else 0
    if args.json:
        print(json.dumps({"old_version": old.version, "new_version": new.version,
                          "profiles": [d.as_json() for d in diffs]}, indent=2))  # fmt: skip
        return changed
    print(f"rules {old.version} -> {new.version}")
    if not diffs:
        print("no effective change in any profile")
    for d in diffs:
        print(f"\nprofile {d.name} ({d.status})")
        for title, items, sign in (
            ("newly allowed", d.newly_allowed, "+"),
            ("no longer allowed", d.no_longer_allowed, "-"),
            ("deny entries added", d.denies_added, "+"),
            ("deny entries removed", d.denies_removed, "-"),
            ("settings", d.settings, "~"),
        ):
            if items:
                print(f"  {title}:")
                for item in items:
                    print(f"    {sign} {item}")
    return changed
