"""A replay report three ways: lines for a terminal, Markdown for a merge request, JSON."""

from __future__ import annotations

from typing import Any

from .replay import Change, ReplayReport


def _json_change(c: Change, n: int) -> dict[str, Any]:
    return {"profile": c.flow.profile, "kind": c.flow.kind, "target": c.flow.target,
            "events": n, "entry_before": c.old_rule or None, "entry_now": c.new_rule or None,
            "reason_now": c.new_reason}  # fmt: skip


def replay_json(r: ReplayReport, version: str, files: list[str]) -> dict[str, Any]:
    return {"rules_version": version, "files": files, "decisions": r.decisions,
            "unchanged": r.unchanged, "not_rule_decisions": r.not_rules,
            "newly_allowed": [_json_change(c, n) for c, n in r.newly(True)],
            "newly_denied": [_json_change(c, n) for c, n in r.newly(False)]}  # fmt: skip


def _summary(r: ReplayReport, version: str) -> str:
    return (f"{r.decisions} rule decision(s) replayed against rules {version}: "
            f"{len(r.newly(True))} flow(s) newly allowed, {len(r.newly(False))} newly "
            f"denied, {r.unchanged} decision(s) unchanged; {r.not_rules} not made by the "
            "rules (not replayed)")  # fmt: skip


def replay_text(r: ReplayReport, version: str) -> list[str]:
    out = [_summary(r, version)]
    for allowed, sign in ((True, "+"), (False, "-")):
        for c, n in r.newly(allowed):
            entry = c.new_rule if allowed else (c.old_rule or "no entry")
            why = f"by {entry}" if allowed else f"{c.new_reason}; was {entry}"
            out.append(f"{sign} {c.flow.profile}: {c.flow} ({n} event(s)) [{why}]")
    return out


def _cell(text: str) -> str:
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`" if text else "-"


def replay_markdown(r: ReplayReport, version: str) -> str:
    out = [f"### Rule replay against `{version}`", "", _summary(r, version) + "."]
    sections = (
        (True, "Newly allowed", "entry that allows it now"),
        (False, "Newly denied", "entry that allowed it before"),
    )
    for allowed, title, col in sections:
        rows = r.newly(allowed)
        out += ["", f"#### {title} ({len(rows)})", ""]
        if not rows:
            out.append("None.")
            continue
        out += [f"| profile | flow | events | {col} | reason now |", "|---|---|---:|---|---|"]
        for c, n in rows:
            entry = c.new_rule if allowed else c.old_rule
            out.append(f"| {_cell(c.flow.profile)} | {c.flow.kind} {_cell(c.flow.target)} "
                       f"| {n} | {_cell(entry)} | {_cell(c.new_reason)} |")  # fmt: skip
    return "\n".join(out) + "\n"
