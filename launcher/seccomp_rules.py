"""The container tier's seccomp filter as data: which system calls the command may not make.

A pure rule list (no I/O): `filter_rules(relax)` returns plain tuples that libseccomp
compiles (`seccomp_bpf.py`); nothing here assembles BPF. The default action is ALLOW (the
tier is not a whitelist); what is listed fails with EPERM so tools print a legible
"Operation not permitted", except clone3, which fails with ENOSYS: its flags sit in a
struct a filter cannot read, and on ENOSYS glibc falls back to clone(2), whose flags
argument is checked (Docker's default profile does the same).

At least as strict as Docker's default profile: what Docker refuses without capabilities
is refused here too, and ptrace (Docker allows it on kernels >= 4.8) with its relatives is
refused unless a profile relaxes it (`sandbox.syscalls` in the rules; the names a profile
may relax are `RELAXABLE`, checked again here so a bad name fails closed).
"""

from __future__ import annotations

import errno
from collections.abc import Iterable

# (syscall name, errno, conditions); a condition is (argument index, "masked_eq", mask,
# value): the call matches when (arg & mask) == value. Several rules for one call: any
# match denies.
Condition = tuple[int, str, int, int]
Rule = tuple[str, int, tuple[Condition, ...]]

# every CLONE_NEW* flag clone(2) accepts (CLONE_NEWTIME, 0x80, is an exit-signal bit there)
CLONE_NEW_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
# personality(2) values Docker allows: PER_LINUX, PER_LINUX32, UNAME26 with either, and the
# query 0xffffffff; anything else (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC...) is refused
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
PERSONALITY_BITS = 32  # the kernel reads an unsigned int: the upper half is ignored

# denied whatever the profile says, grouped by why
DENIED: dict[str, tuple[str, ...]] = {
    "namespaces": ("unshare", "setns"),
    "mounts": ("mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "fsopen",
               "fsconfig", "fsmount", "fspick", "open_tree", "mount_setattr"),
    "file handles": ("open_by_handle_at", "name_to_handle_at"),
    "keyrings": ("add_key", "request_key", "keyctl"),
    "kernel programs": ("bpf", "userfaultfd", "io_uring_setup", "io_uring_enter",
                        "io_uring_register"),
    "kernel images and modules": ("kexec_load", "kexec_file_load", "init_module",
                                  "finit_module", "delete_module", "create_module",
                                  "get_kernel_syms", "query_module"),
    "host administration": ("acct", "swapon", "swapoff", "reboot", "syslog", "quotactl",
                            "quotactl_fd", "nfsservctl", "fanotify_init", "lookup_dcookie",
                            "vhangup", "sysfs", "_sysctl", "ustat", "uselib"),
    "clocks": ("settimeofday", "stime", "clock_settime", "clock_adjtime", "adjtimex"),
    "legacy i/o and modes": ("vm86", "vm86old", "ioperm", "iopl"),
    "memory placement": ("move_pages", "migrate_pages"),
}
# Calls newer than the libseccomp of Debian 12's binding (2.5.4 names calls up to
# futex_wait, 455), reviewed through Linux 6.18: their numbers, the same on every ABI since
# Linux 5.1's common numbering. libseccomp cannot name them, so the guard in front of its
# program (`seccomp_guard.py`) judges them by number: NEWER_DENIED fail with EPERM, the rest
# are allowed (mount and LSM information, xattrs and file attributes by fd, mseal, futex2),
# and every number past LAST_REVIEWED fails with ENOSYS until someone reviews it here.
NEWER_CALLS: dict[str, int] = {
    "futex_requeue": 456, "statmount": 457, "listmount": 458, "lsm_get_self_attr": 459,
    "lsm_set_self_attr": 460, "lsm_list_modules": 461, "mseal": 462, "setxattrat": 463,
    "getxattrat": 464, "listxattrat": 465, "removexattrat": 466, "open_tree_attr": 467,
    "file_getattr": 468, "file_setattr": 469,
}
LAST_REVIEWED = max(NEWER_CALLS.values())  # 469, file_setattr: the last of Linux 6.18
NEWER_DENIED = ("open_tree_attr",)  # open_tree and mount_setattr in one: a mount call
# denied unless a profile relaxes them by name (`sandbox.syscalls.allow`, with a reason)
RELAXABLE: tuple[str, ...] = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
                              "pidfd_getfd", "personality", "perf_event_open")


def masked_complement(allowed: Iterable[int], bits: int) -> list[tuple[int, int]]:
    """(mask, value) pairs whose matches, over the low `bits` bits, are exactly the values
    NOT in `allowed`: the sibling subtrees off the paths to the allowed values in a binary
    trie. libseccomp takes one comparison per argument per rule, so "not one of these" is
    a union of masked comparisons, each its own rule."""
    full = (1 << bits) - 1
    keep = {v & full for v in allowed}
    out: list[tuple[int, int]] = []
    prefixes = {0}  # values of the top `depth` bits that some allowed value has
    for depth in range(1, bits + 1):
        shift = bits - depth
        mask = (full >> shift) << shift
        nxt = {v & mask for v in keep}
        for p in sorted(prefixes):
            for child in (p, p | (1 << shift)):
                if child not in nxt:
                    out.append((mask, child))
        prefixes = nxt
    return out


def _personality() -> list[Rule]:
    return [("personality", errno.EPERM, ((0, "masked_eq", mask, value),))
            for mask, value in masked_complement(PERSONALITY_ALLOWED, PERSONALITY_BITS)]


def _clone() -> list[Rule]:
    rules: list[Rule] = [("clone", errno.EPERM, ((0, "masked_eq", flag, flag),))
                         for flag in CLONE_NEW_FLAGS.values()]
    return [*rules, ("clone3", errno.ENOSYS, ())]


def denied_names() -> tuple[str, ...]:
    """Every call the default filter refuses outright (without argument conditions)."""
    return tuple(n for names in DENIED.values() for n in names) + tuple(
        n for n in RELAXABLE if n != "personality")


def filter_rules(relax: Iterable[str] = ()) -> tuple[Rule, ...]:
    """The filter for the container tier (and the microVM guest), minus the relaxed calls.
    Raises ValueError for a name that may not be relaxed."""
    relaxed = frozenset(relax)
    bad = sorted(relaxed - set(RELAXABLE))
    if bad:
        raise ValueError(f"system call(s) {', '.join(bad)} cannot be allowed (relaxable: "
                         f"{', '.join(RELAXABLE)})")
    rules: list[Rule] = [(n, errno.EPERM, ()) for names in DENIED.values() for n in names]
    rules += _clone()
    rules += [(n, errno.EPERM, ()) for n in RELAXABLE
              if n not in relaxed and n != "personality"]
    if "personality" not in relaxed:
        rules += _personality()
    return tuple(rules)


def guard_numbers() -> tuple[int, tuple[int, ...]]:
    """(the last reviewed call number, the newer calls' numbers the filter denies)."""
    return LAST_REVIEWED, tuple(NEWER_CALLS[n] for n in NEWER_DENIED)
