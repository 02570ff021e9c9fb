"""A BPF prefix for the seccomp filter: what libseccomp cannot say.

The tier's filter allows by default (`seccomp_rules.py`), so a system call the kernel gains
after the rule list was reviewed would be allowed without anyone having decided it, and
libseccomp compares only names it knows (Debian 12's 2.5.4 stops at futex_wait, 455) with
no "greater than" on the call number. This prefix runs first: every number past the last
reviewed call fails with ENOSYS (what a kernel without the call answers, so programs take
their fallback), the reviewed calls the rules deny but libseccomp cannot name fail with
EPERM, and everything else falls through into libseccomp's program, which begins by
loading the architecture itself.

Hand-assembled: a dozen classic-BPF instructions; no maintained Python library assembles
seccomp BPF, and libseccomp itself is what cannot express this.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Iterable

# classic BPF opcodes (linux/filter.h) and struct seccomp_data's offsets
LD_ABS_W = 0x20
JA, JEQ, JGT, JGE, JSET = 0x05, 0x15, 0x25, 0x35, 0x45
AND_K = 0x54
RET_K = 0x06
OFF_NR, OFF_ARCH = 0, 4
RET_ERRNO = 0x00050000
AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000  # x86_64's x32 calls: the number with this bit set
X32_OWN = (512, 547)  # x32's own numbers (its variants of older calls): libseccomp's to judge
INSN = struct.Struct("=HBBI")  # struct sock_filter, in the host's byte order

# (opcode, k, jump-if-true label, jump-if-false label) or (opcode, k) or a label string
Op = tuple[int, int] | tuple[int, int, str, str] | str


def _ops(last: int, denied: tuple[int, ...]) -> list[Op]:
    ops: list[Op] = [
        (LD_ABS_W, OFF_ARCH),
        (JEQ, AUDIT_ARCH_X86_64, "x86_64", "nr"),
        "x86_64", (LD_ABS_W, OFF_NR),
        (JSET, X32_BIT, "x32", "check"),
        "x32", (AND_K, ~X32_BIT & 0xFFFFFFFF),
        (JGE, X32_OWN[0], "x32own", "check"),
        "x32own", (JGT, X32_OWN[1], "enosys", "pass"),
        "nr", (LD_ABS_W, OFF_NR),
        "check", (JGT, last, "enosys", "deny0" if denied else "allow"),
    ]
    for i, nr in enumerate(denied):
        ops += [f"deny{i}", (JEQ, nr, "eperm", f"deny{i + 1}" if i + 1 < len(denied) else "allow")]
    return [*ops, "allow", (JA, 0, "pass", "pass"),
            "enosys", (RET_K, RET_ERRNO | errno.ENOSYS),
            "eperm", (RET_K, RET_ERRNO | errno.EPERM), "pass"]


def program(last: int, denied: Iterable[int]) -> bytes:
    """The prefix: ENOSYS above `last` (on every ABI, x32's own range aside), EPERM for the
    numbers in `denied` (Linux's common numbering, the same on every ABI since 5.1)."""
    nums = tuple(sorted(set(denied)))
    if any(not 0 <= n <= last for n in nums) or not 0 < last < X32_OWN[0]:
        raise ValueError("denied numbers must lie in 0..last, and last below x32's own")
    ops = _ops(last, nums)
    where: dict[str, int] = {}
    insns: list[tuple[int, int, str, str] | tuple[int, int]] = []
    for op in ops:
        if isinstance(op, str):
            where[op] = len(insns)
        else:
            insns.append(op)
    out = bytearray()
    for pc, insn in enumerate(insns):
        code, k = insn[0], insn[1]
        if len(insn) == 2:
            out += INSN.pack(code, 0, 0, k)
            continue
        jt, jf = (where[label] - pc - 1 for label in insn[2:])  # type: ignore[misc]
        if code == JA:
            out += INSN.pack(code, 0, 0, jt)
        else:
            out += INSN.pack(code, jt, jf, k)
    return bytes(out)
