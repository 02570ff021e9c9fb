"""A pooled microVM guest's wait for its claim (the guest side of `microvm.pooled_plan` and
`plan_frame`), loaded by guest_init.py from the pooled plan's modules: builtins only, no
launcher import. `init` is guest_init.py itself (the guest's `__main__`), whose steps a
cold start's guest runs from its plan; here they run before any task exists, with what
the pooled plan says every task of the pool runs under (`ahead`).
"""

import _signal as signal  # the C module: `signal` would import enum (and re) first
import marshal
import os

POOLED_READY = b"stockade-pooled-ready\n"  # microvm.POOLED_READY
MAX_PLAN_BYTES = 16 * 2**20  # microvm.MAX_PLAN_BYTES
WARMUP_S = 10  # a warm-up command still running then is killed (SIGALRM)
# a warm-up's environment, with the locale a task of the pool gets (the pooled plan's
# `warmup_locale`): a start under another locale runs (and loads) other code than the
# claim's command would
WARMUP_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
CLONE_NEWNS = 0x20000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise OSError("the launcher closed the agent port")
        buf += chunk
    return bytes(buf)


def claimed(init, pooled, out_fd, err_fd):
    """Load what the claim's start would (`libc`), check the image and read the input
    table (`image_checked`), take the slot's fresh identity and network, put in force what
    every task of the pool runs under, say so on the agent port (root's alone), then wait
    there for the task's plan: a 4-byte big-endian length and the marshal bytes
    (microvm.plan_frame; its inputs' bytes too: guest_inputs.py), checked against this
    guest's (`check`). (The task's plan, the open agent port, the command's cgroup, its
    child (None when the plan's filter is not the one it loaded: `keep_child`), the
    input table.)"""
    init.libc()  # what the claim's start would load (become, load_filter, refresh)
    table = init.image_checked()  # the same for any task: not on the claim's path
    # its slot's identity and network, known before any task: a claim spawns no `ip`
    # (each spawn forks the init's Python under emulation); the services deny the
    # address as unclaimed until the claim, and nothing here sends
    init.refresh(pooled["fresh"])
    init.network(pooled["net"])
    # what every task of its pool runs under (the names, the cgroup's limits, the user)
    ahead = pooled["ahead"]
    init.sysctls(ahead)
    # the command's cgroup and its process, forked and waiting on a pipe for the plan: a
    # claim forks nothing (a fork of the init's Python and the cgroup's controllers cost
    # 10-50 ms under emulation); it is given the plan once the inputs are in place. It
    # loads the pool's seccomp filter (a profile's without relaxations) while it waits
    cg = init.limit_cgroup(init.make_cgroup(), ahead)
    command = init.fork_child(None, cg, (out_fd, err_fd),
                              ahead=dict(ahead, seccomp=pooled["seccomp"]))
    for argv in pooled.get("warmup", ()):
        warm_up(init, ahead, argv, pooled.get("warmup_locale", {}))
    command = settled(init, cg, command)
    port = init.agent_port()
    os.write(port, POOLED_READY)
    n = int.from_bytes(read_exact(port, 4), "big")
    if n > MAX_PLAN_BYTES:
        raise OSError("the plan on the agent port is too large")
    plan = marshal.loads(read_exact(port, n))  # noqa: S302 - the launcher's
    check(pooled, plan)
    return plan, port, cg, keep_child(pooled, plan, command), table


def settled(init, cg, command):
    """The command's child (pid, its pipe) once it has said on its ready pipe (`command`'s
    third item, fork_child) that it is the sandbox user under the pool's filter, moved
    into the command's cgroup `cg` while it waits for its plan: a claim then moves nothing
    (a cgroup.procs write costs ms under emulation), and nothing the child did ahead was
    charged there. None (its pipe closed: it leaves) when it ended first or could not
    join: the claim forks a fresh child."""
    pid, ctl, ready = command
    try:
        said = os.read(ready, 1)
    finally:
        os.close(ready)
    if not said:
        os.close(ctl)
        return None
    try:
        init.admit(cg, pid)
    except OSError:  # at the pids limit: the claim's fresh child fails to join too, says why
        os.close(ctl)
        return None
    return pid, ctl


def keep_child(pooled, plan, command):
    """The command's child forked ahead (pid, its pipe) when it may run the plan's command:
    it is under the pool's filter (`pooled["seccomp"]`), so only a plan whose filter is
    exactly those bytes. Otherwise (a profile that relaxes a call: stacked, the stricter
    filter would hold) None, its pipe closed (it leaves without running anything): the
    init forks a fresh child, which loads the plan's filter as a cold start's does."""
    if command is None or plan.get("seccomp") == pooled["seccomp"]:
        return command
    os.close(command[1])
    return None


def warm_up(init, ahead, argv, locale=None):
    """Run `argv` once and wait for its end (at most WARMUP_S): as the sandbox user, outside
    the task's cgroup, with /dev/null as stdio and a fixed environment (WARMUP_ENV and the
    pool's `locale` variables: LANG, LC_*); before the agent
    port is open and before any task exists, so there is nothing of one it could reach.
    Under TCG a command's first start translates its code; the claim's start then finds
    the translation (and the page cache) warm. A failure is no failure of the guest."""
    pid = os.fork()
    if pid == 0:
        try:
            fd = os.open("/dev/null", os.O_RDWR)
            read_only_view(init.libc())
            for i in range(3):
                os.dup2(fd, i)
            os.closerange(3, 1024)
            os.chdir("/")
            init.become(ahead)
            signal.alarm(WARMUP_S)  # survives the exec: the kernel ends a hung one
            os.execve(argv[0], argv, dict(locale or {}, **WARMUP_ENV))  # noqa: S606
        finally:
            os._exit(127)
    try:  # noqa: SIM105 - no contextlib: an import costs a lot under emulation
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def read_only_view(libc):
    """This process's mounts, in a mount namespace of its own, all read-only: what a
    warm-up writes (to /scratch, /tmp) cannot outlive it. `libc`: guest_init.libc()."""
    ctypes, lib, _ = libc
    if lib.unshare(CLONE_NEWNS) != 0 or \
            lib.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "cannot make the warm-up's mount namespace")
    with open("/proc/self/mounts", "rb") as fh:
        mounts = [line.split() for line in fh]
    for m in mounts:
        if b"rw" not in m[3].split(b","):
            continue
        # /proc/self/mounts escapes a space, tab, newline and backslash in octal
        target = m[1].decode("unicode_escape").encode("latin-1")
        if lib.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) != 0:
            raise OSError(ctypes.get_errno(), f"cannot make {target!r} read-only")


def check(pooled, plan):
    """OSError unless `plan` is for this guest's address and MAC and asks for exactly what
    was put in force ahead: no command runs under other limits than its plan's."""
    if (plan["net"], plan["fresh"]["mac"]) != (pooled["net"], pooled["fresh"]["mac"]):
        raise OSError("the plan is not for this pooled guest's address")
    if {k: plan.get(k) for k in pooled["ahead"]} != pooled["ahead"]:
        raise OSError("the plan's user, rlimits or limits are not this pooled guest's")
