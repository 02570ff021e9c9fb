"""The seccomp filter's BPF program for one profile: the rule list (`seccomp_rules.py`)
compiled by libseccomp (`seccomp_compiler.py`, run by the host's system Python, which has
the binding), cached per rule set so a sandbox start pays nothing after the first.

The sandbox's init loads the bytes with prctl(PR_SET_SECCOMP) right before it executes the
command; see docs/launcher.md.
"""

from __future__ import annotations

import functools
import marshal
import subprocess
from pathlib import Path
from typing import Any

from . import seccomp_guard
from .seccomp_rules import Rule, filter_rules, guard_numbers

BPF_INSN = 8  # bytes of one struct sock_filter
LOAD_ARCH = seccomp_guard.INSN.pack(seccomp_guard.LD_ABS_W, 0, 0, seccomp_guard.OFF_ARCH)


class SeccompError(RuntimeError):
    """The filter could not be built: the sandbox must not start without it."""


def profile_relaxations(profile: Any) -> frozenset[str]:
    """The calls the profile relaxes (`sandbox.syscalls.allow`), none by default."""
    relax = getattr(profile, "syscalls", None)
    return frozenset(relax.allow) if relax is not None else frozenset()


def filter_for(python: str, profile: Any) -> bytes:
    try:
        rules = filter_rules(profile_relaxations(profile))
    except ValueError as e:
        raise SeccompError(f"profile {getattr(profile, 'name', '?')!r}: {e}") from None
    return compile_rules(python, rules)


@functools.cache
def compile_rules(python: str, rules: tuple[Rule, ...]) -> bytes:
    """libseccomp's program for `rules`, behind the guard for the calls it cannot name
    (`seccomp_guard.py`)."""
    out = _compiler(python, rules)
    if not out or len(out) % BPF_INSN:
        raise SeccompError(f"the seccomp compiler gave {len(out)} bytes, not a program")
    if out[:BPF_INSN] != LOAD_ARCH:  # the guard falls through: it must load its own input
        raise SeccompError("libseccomp's program does not begin by loading the architecture")
    return seccomp_guard.program(*guard_numbers()) + out


def filter_text(python: str, rules: tuple[Rule, ...]) -> str:
    """The same filter as libseccomp's pseudo-filter code (architectures, rules, actions)."""
    return _compiler(python, rules, "--pfc").decode()


def _compiler(python: str, rules: tuple[Rule, ...], *args: str) -> bytes:
    source = Path(__file__).with_name("seccomp_compiler.py").read_text()
    try:
        r = subprocess.run([python, "-I", "-c", source, *args], input=marshal.dumps(rules, 4),
                           capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SeccompError(f"cannot build the seccomp filter with {python}: {e}") from None
    if r.returncode != 0:
        lines = r.stderr.decode(errors="replace").strip().splitlines() or ["no output"]
        hint = " (install python3-seccomp)" if "No module named" in lines[-1] else ""
        raise SeccompError(f"cannot build the seccomp filter with {python}: "
                           f"{lines[-1]}{hint}")
    return r.stdout
