"""The seccomp filter's rule list (pure) and its compilation by libseccomp."""

from __future__ import annotations

import errno
import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st
from stockade.launcher import seccomp_bpf
from stockade.launcher.seccomp_rules import (
    CLONE_NEW_FLAGS,
    PERSONALITY_ALLOWED,
    RELAXABLE,
    filter_rules,
    masked_complement,
)
from stockade.policy.model import RELAXABLE_SYSCALLS, SyscallRelaxation

SYSTEM_PYTHON = "/usr/bin/python3"  # the init's interpreter, with python3-seccomp


def _matches(pairs: list[tuple[int, int]], v: int) -> bool:
    return any(v & mask == value for mask, value in pairs)


@given(st.integers(0, 2**32 - 1))
def test_personality_complement_is_exact(v: int) -> None:
    pairs = masked_complement(PERSONALITY_ALLOWED, 32)
    assert _matches(pairs, v) == (v not in PERSONALITY_ALLOWED)


@given(st.sets(st.integers(0, 255), max_size=6))
def test_masked_complement_any_set(allowed: set[int]) -> None:
    pairs = masked_complement(allowed, 8)
    assert [v for v in range(256) if not _matches(pairs, v)] == sorted(allowed)


def test_personality_edge_values() -> None:
    pairs = masked_complement(PERSONALITY_ALLOWED, 32)
    for v in (0x0040000, 0x0400000, 0x0100000, 1, 9, 0xFFFFFFFE):  # ADDR_NO_RANDOMIZE...
        assert _matches(pairs, v)


def _by_name(rules: tuple[seccomp_bpf.Rule, ...]) -> dict[str, list[seccomp_bpf.Rule]]:
    out: dict[str, list[seccomp_bpf.Rule]] = {}
    for r in rules:
        out.setdefault(r[0], []).append(r)
    return out


def test_default_rules() -> None:
    rules = _by_name(filter_rules())
    for name in ("unshare", "setns", "mount", "umount2", "pivot_root", "open_by_handle_at",
                 "name_to_handle_at", "add_key", "request_key", "keyctl", "bpf",
                 "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
                 "io_uring_register", "kexec_load", "kexec_file_load", "init_module",
                 "finit_module", "delete_module", "ptrace", "acct", "swapon", "swapoff",
                 "reboot", "settimeofday", "clock_settime", "adjtimex", "quotactl",
                 "lookup_dcookie", "vm86", "nfsservctl", "fanotify_init", "move_mount",
                 "fsopen", "fsmount", "fspick", "open_tree", "mount_setattr", "syslog",
                 "chroot"):
        assert rules[name] == [(name, errno.EPERM, ())], name
    assert rules["clone3"] == [("clone3", errno.ENOSYS, ())]
    # one rule per namespace flag: any of them set in clone's flags is refused
    assert sorted(r[2][0][2] for r in rules["clone"]) == sorted(CLONE_NEW_FLAGS.values())
    assert all(r[2][0][2] == r[2][0][3] for r in rules["clone"])
    assert len(rules["personality"]) == len(masked_complement(PERSONALITY_ALLOWED, 32))


def test_relaxing() -> None:
    relaxed = _by_name(filter_rules(["ptrace", "personality"]))
    assert "ptrace" not in relaxed and "personality" not in relaxed
    assert "process_vm_readv" in relaxed and "unshare" in relaxed
    for bad in ("mount", "unshare", "bpf", "clone", "nonesuch"):
        with pytest.raises(ValueError, match="cannot be allowed"):
            filter_rules([bad])


def test_policy_and_filter_agree_on_relaxable_names() -> None:
    assert set(RELAXABLE_SYSCALLS) == set(RELAXABLE)


def test_compiles_for_every_abi() -> None:
    rules = filter_rules()
    bpf = seccomp_bpf.compile_rules(SYSTEM_PYTHON, rules)
    assert len(bpf) % 8 == 0 and 100 < len(bpf) // 8 < 4096  # the kernel's BPF_MAXINSNS
    assert seccomp_bpf.compile_rules(SYSTEM_PYTHON, rules) is bpf  # cached per rule set
    text = seccomp_bpf.filter_text(SYSTEM_PYTHON, rules)
    for arch in ("x86_64", "x86", "x32"):
        assert f"# filter for arch {arch} " in text
    # a call through any other ABI ends the process
    assert text.split("# invalid architecture action")[1].split()[:2] == ["action", "KILL;"]


def test_profile_filter() -> None:
    plain = types.SimpleNamespace(name="p", syscalls=None)
    debug = types.SimpleNamespace(
        name="d", syscalls=SyscallRelaxation(frozenset({"ptrace"}), "debugger"))
    assert seccomp_bpf.profile_relaxations(plain) == frozenset()
    assert seccomp_bpf.filter_for(SYSTEM_PYTHON, plain) != seccomp_bpf.filter_for(
        SYSTEM_PYTHON, debug)
    forged = types.SimpleNamespace(
        name="f", syscalls=SyscallRelaxation(frozenset({"mount"}), "no"))
    with pytest.raises(seccomp_bpf.SeccompError, match=r"'f'.*mount cannot be allowed"):
        seccomp_bpf.filter_for(SYSTEM_PYTHON, forged)


def test_fails_closed_without_the_binding() -> None:
    # this test's interpreter (the project's venv) has no libseccomp binding
    with pytest.raises(seccomp_bpf.SeccompError, match="install python3-seccomp"):
        seccomp_bpf.compile_rules(sys.executable, filter_rules())
    with pytest.raises(seccomp_bpf.SeccompError, match="cannot build"):
        seccomp_bpf.compile_rules("/nonexistent/python3", filter_rules())


def test_unknown_name_is_an_error() -> None:
    with pytest.raises(seccomp_bpf.SeccompError, match="unknown system call 'no_such_call'"):
        seccomp_bpf.compile_rules(SYSTEM_PYTHON, (("no_such_call", errno.EPERM, ()),))
