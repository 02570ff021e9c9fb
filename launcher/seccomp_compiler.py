"""Compiles the seccomp rule list (`seccomp_rules.py`, marshal on stdin) to the BPF program
the kernel loads (stdout), with libseccomp's own Python binding (Debian's python3-seccomp).

Run by the host's system Python (the one that runs the sandbox's init; the binding is built
for it), never inside a sandbox; `--pfc` prints the filter as text instead. The filter
covers the native architecture and its compatibility ABIs (i386 and x32 on x86_64): a
call through another ABI kills the process (libseccomp's default for a foreign
architecture). A name that no covered ABI knows is an error, so a typo cannot drop a rule
silently.
"""

import marshal
import os
import sys

import seccomp

COMPAT = {"x86_64": ("X86", "X32"), "aarch64": ("ARM",)}


def main():
    rules = marshal.loads(sys.stdin.buffer.read())  # noqa: S302 - written by the launcher
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    # a binary tree over the syscall numbers: calls not in the list take a few compares
    f.set_attr(seccomp.Attr.CTL_OPTIMIZE, 2)
    arches = [seccomp.Arch.NATIVE]
    for name in COMPAT.get(os.uname().machine, ()):
        arch = getattr(seccomp.Arch, name)
        f.add_arch(arch)
        arches.append(arch)
    ops = {"masked_eq": seccomp.MASKED_EQ}
    for name, err, conds in rules:
        if all(seccomp.resolve_syscall(a, name) < 0 for a in arches):
            raise SystemExit(f"unknown system call {name!r}")
        args = [seccomp.Arg(i, ops[op], mask, value) for i, op, mask, value in conds]
        f.add_rule(seccomp.ERRNO(err), name, *args)
    # --pfc: libseccomp's readable pseudo-filter code instead, for review and tests
    (f.export_pfc if sys.argv[1:] == ["--pfc"] else f.export_bpf)(sys.stdout)


main()
