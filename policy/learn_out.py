"""A learned proposal as a profile file (YAML, with the evidence as comments) or JSON.

Scalars are written as JSON strings, which are YAML too, so no name or path can break
the file; the loader reads the result like any hand-written profile."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from .learn import TODO, Proposal


def _q(v: Any) -> str:
    return json.dumps(v)


def _why(ev: dict[str, Any]) -> str:
    return f"# evidence: {ev['events']} event(s) in {ev['tasks']} of {ev['of']} task(s)"


def _destination(target: str) -> str:
    try:
        ip = ipaddress.ip_address(target)
    except ValueError:
        return f"host: {_q(target)}"
    return f"cidr: {_q(f'{ip}/{ip.max_prefixlen}')}"


def _allow_lines(e: dict[str, Any]) -> list[str]:
    lines = [f"    {_why(e['evidence'])}",
             f"    - {_destination(e['target'])}",
             f"      ports: [{', '.join(str(x) for x in e['ports'])}]",
             f"      reason: {TODO}"]  # fmt: skip
    if e["methods"]:
        methods = ", ".join(_q(m) for m in e["methods"])
        paths = ", ".join(_q(x) for x in e["paths"])
        lines.append(f"      http: {{methods: [{methods}], paths: [{paths}]}}")
    return lines


def proposal_yaml(p: Proposal, name: str) -> str:
    share = f"{p.min_share:g}"
    out = [f"# proposed by `stockade rules learn` from {len(p.tasks)} task(s) "
           f"(kept: needed by at least {share} of them): {', '.join(p.tasks)}",
           "# fill in every 'reason: TODO' (why the task needs it) or remove the entry",
           f"profile: {_q(name)}",
           f"description: {TODO}",
           "egress:",
           "  mode: enforce"]  # fmt: skip
    if p.allow:
        out.append("  allow:")
        for e in p.allow:
            out.extend(_allow_lines(e))
    if p.broker:
        out += ["broker:", "  apis:"]
        for api, ops in p.broker.items():
            out += [f"    {_q(api)}:", "      operations:"]
            for op in ops:
                out.append(f"        - {{method: {_q(op['method'])}, path: {_q(op['path'])}}}"
                           f"  {_why(op['evidence'])}")  # fmt: skip
    for d in p.dropped:
        out.append(f"# not proposed (too few tasks): {d}")
    for name_, n in sorted(p.denied.items()):
        out.append(f"# denied while recorded, not proposed: {name_} ({n} event(s))")
    return "\n".join(out) + "\n"


def proposal_json(p: Proposal, name: str) -> dict[str, Any]:
    return {"profile": name, "tasks": p.tasks, "min_share": p.min_share, "allow": p.allow,
            "broker": p.broker, "dropped": p.dropped, "denied": p.denied}  # fmt: skip
