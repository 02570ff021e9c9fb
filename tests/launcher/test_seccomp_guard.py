"""The guard in front of libseccomp's program (`seccomp_guard.py`), run instruction by
instruction on a small classic-BPF interpreter: calls past the last reviewed number fail
with ENOSYS on every ABI, the newer denied calls with EPERM, everything else reaches
libseccomp's program (the instruction right after the guard)."""

from __future__ import annotations

import errno
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from stockade.launcher import seccomp_bpf, seccomp_guard
from stockade.launcher.seccomp_rules import (
    LAST_REVIEWED,
    NEWER_CALLS,
    NEWER_DENIED,
    filter_rules,
    guard_numbers,
)

from .test_launcher_seccomp_pure import SYSTEM_PYTHON

G = seccomp_guard
ARCHES = {"x86_64": G.AUDIT_ARCH_X86_64, "i386": 0x40000003, "aarch64": 0xC00000B7,
          "arm": 0x40000028}
PASS = "pass"
JUMPS = {G.JEQ: lambda a, k: a == k, G.JGT: lambda a, k: a > k,
         G.JGE: lambda a, k: a >= k, G.JSET: lambda a, k: bool(a & k)}


def run(prog: bytes, arch: int, nr: int) -> str | int:
    """The guard's answer for (arch, nr): an errno, or PASS when control reaches the
    instruction after it. Only the opcodes the guard may use are known: any other fails."""
    data = struct.pack("=iI", nr - (1 << 32) if nr >= 1 << 31 else nr, arch)
    insns = [G.INSN.unpack_from(prog, i) for i in range(0, len(prog), 8)]
    a, pc = 0, 0
    for _ in range(len(insns) + 1):  # forward jumps only: each instruction runs once at most
        if pc == len(insns):
            return PASS
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == G.LD_ABS_W:
            a = struct.unpack_from("=I", data, k)[0]
        elif code == G.AND_K:
            a &= k
        elif code == G.JA:
            pc += k
        elif code in JUMPS:
            pc += jt if JUMPS[code](a, k) else jf
        elif code == G.RET_K:
            assert k & 0xFFFF0000 == G.RET_ERRNO, hex(k)
            return k & 0xFFFF
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        assert pc <= len(insns), "a jump past the guard's end"
    raise AssertionError("the guard did not end")


def expected(arch: str, nr: int, last: int, denied: set[int]) -> str | int:
    n = nr
    if arch == "x86_64" and nr & G.X32_BIT:
        n = nr & ~G.X32_BIT
        if G.X32_OWN[0] <= n <= G.X32_OWN[1]:
            return PASS
        if n > G.X32_OWN[1]:
            return errno.ENOSYS
    if n > last:
        return errno.ENOSYS
    return errno.EPERM if n in denied else PASS


NUMBERS = st.one_of(st.integers(0, 600), st.integers(0, 2**32 - 1),
                    st.integers(0, 600).map(lambda n: n | G.X32_BIT))


@given(st.sampled_from(sorted(ARCHES)), NUMBERS)
def test_the_shipped_guard(arch: str, nr: int) -> None:
    last, denied = guard_numbers()
    assert run(G.program(last, denied), ARCHES[arch], nr) == expected(arch, nr, last,
                                                                      set(denied))


@given(st.integers(1, 511), st.sets(st.integers(0, 511), max_size=5),
       st.sampled_from(sorted(ARCHES)), NUMBERS)
def test_any_guard(last: int, denied: set[int], arch: str, nr: int) -> None:
    denied = {d for d in denied if d <= last}
    assert run(G.program(last, denied), ARCHES[arch], nr) == expected(arch, nr, last, denied)


def test_the_numbers_in_force() -> None:
    last, denied = guard_numbers()
    assert last == LAST_REVIEWED == max(NEWER_CALLS.values())
    assert denied == (NEWER_CALLS["open_tree_attr"],) == (467,)
    assert set(NEWER_DENIED) <= set(NEWER_CALLS)
    x86 = G.program(last, denied)
    for nr, answer in ((0, PASS), (272, PASS), (457, PASS), (467, errno.EPERM),
                       (469, PASS), (470, errno.ENOSYS), (1000, errno.ENOSYS),
                       (G.X32_BIT | 467, errno.EPERM), (G.X32_BIT | 520, PASS),
                       (G.X32_BIT | 548, errno.ENOSYS), (2**32 - 1, errno.ENOSYS)):
        assert run(x86, G.AUDIT_ARCH_X86_64, nr) == answer, nr


def test_bad_numbers_are_refused() -> None:
    for last, denied in ((469, [470]), (0, []), (512, []), (469, [-1])):
        with pytest.raises(ValueError):
            G.program(last, denied)


def test_the_filter_is_the_guard_then_libseccomp() -> None:
    bpf = seccomp_bpf.compile_rules(SYSTEM_PYTHON, filter_rules())
    guard = G.program(*guard_numbers())
    assert bpf.startswith(guard)
    assert bpf[len(guard):len(guard) + 8] == seccomp_bpf.LOAD_ARCH
