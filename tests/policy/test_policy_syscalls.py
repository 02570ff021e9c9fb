"""`sandbox.syscalls`: the only way a profile relaxes the sandbox's seccomp filter."""

from __future__ import annotations

import json

import pytest
from stockade.policy import RulesError, load_rules
from stockade.policy.diff import diff_rulesets
from stockade.policy.lint import lint_ruleset

from stockade.cli import main

DEBUG = """
profile: p
sandbox:
  syscalls:
    allow: [ptrace, process_vm_readv]
    reason: debugger tests attach to their own children
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["rules", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_relaxation_loads(write_rules):
    p = load_rules(write_rules(profiles={"p": DEBUG})).profiles["p"]
    assert p.syscalls is not None
    assert p.syscalls.allow == frozenset({"ptrace", "process_vm_readv"})
    assert p.syscalls.reason == "debugger tests attach to their own children"
    assert p.syscalls.location is not None and p.syscalls.location.line == 4


def test_default_has_no_relaxation(write_rules):
    assert load_rules(write_rules(profiles={"p": "profile: p\n"})).profiles["p"].syscalls is None


@pytest.mark.parametrize(("body", "message"), [
    ("allow: [mount]\n    reason: r", "p.yaml:4:13: sandbox.syscalls.allow[0]: system call "
     "'mount' cannot be allowed: the sandbox's seccomp filter relaxes only ptrace"),
    ("allow: [unshare]\n    reason: r", "'unshare' cannot be allowed"),
    ("allow: [bpf]\n    reason: r", "'bpf' cannot be allowed"),
    ("allow: [ptrace]", "sandbox.syscalls.reason: required key is missing"),
    ("allow: [ptrace]\n    reason: '  '", "reason must say why"),
    ("allow: []\n    reason: r", "sandbox.syscalls.allow"),
    ("allow: [ptrace, ptrace]\n    reason: r", "listed twice: ptrace"),
    ("allow: ptrace\n    reason: r", "sandbox.syscalls.allow"),
    ("allow: [ptrace]\n    reason: r\n    deny: [x]", "sandbox.syscalls.deny"),
])
def test_bad_relaxations_refused(write_rules, body, message):
    root = write_rules(profiles={"p": f"profile: p\nsandbox:\n  syscalls:\n    {body}\n"})
    with pytest.raises(RulesError) as ei:
        load_rules(root)
    text = str(ei.value)
    assert message.lower() in text.lower(), text


def test_lint_and_explain_show_the_relaxation(capsys, write_rules):
    root = write_rules(profiles={"p": DEBUG})
    warnings = [str(w) for w in lint_ruleset(load_rules(root))]
    assert warnings == ["%s:4:5: warning: sandbox.syscalls: profile 'p' lets process_vm_readv, "
                        "ptrace through the seccomp filter (reason: debugger tests attach to "
                        "their own children)" % (root / "profiles" / "p.yaml")]
    rc, out, _ = run(capsys, "lint", str(root))
    assert rc == 0 and "lets process_vm_readv, ptrace through the seccomp filter" in out
    rc, out, _ = run(capsys, "explain", "--rules", str(root), "-p", "p", "x.test:443")
    assert rc == 1 and ("sandbox:  the seccomp filter lets process_vm_readv, ptrace through "
                        "(debugger tests attach to their own children)") in out
    rc, out, _ = run(capsys, "explain", "--rules", str(root), "-p", "p", "--json", "x.test:443")
    assert json.loads(out)["syscalls_allowed"] == ["process_vm_readv", "ptrace"]


def test_relaxation_changes_the_policy_version(write_rules, tmp_path):
    a = load_rules(write_rules(profiles={"p": DEBUG})).version
    b = load_rules(write_rules(profiles={"p": DEBUG.replace(", process_vm_readv", "")})).version
    assert a != b


def test_diff_shows_a_relaxation(tmp_path, write_rules):
    old = load_rules(write_rules(profiles={"p": "profile: p\n"}))
    new = load_rules(write_rules(profiles={"p": DEBUG}))
    (d,) = diff_rulesets(old, new)
    assert d.settings == ["sandbox.syscalls allowed through the seccomp filter: none -> "
                          "process_vm_readv, ptrace"]
    assert diff_rulesets(new, new) == []
