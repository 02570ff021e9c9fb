"""The microVM guest's init (pid 1 after vm-images/init), run by the host's Python from the
read-only /usr share with `-I -S`. The launcher copies it onto the config share. Only
builtin modules (and `resource`): every import is read over 9p and run under emulation
when the host has no KVM, where `json`, `ctypes` or `signal` (enum, re, ...) cost a second.
vm-images/init has already built the filesystem, copied the plan to /sbx/run, unmounted
the config share and made the root read-only.

It reads the plan (`microvm.guest_plan`, marshal: data, never parsed as shell), sets up
eth0 (busybox `ip`, argument lists), puts the command in a cgroup with the profile's
limits, and only then mounts the inputs (a target at or under a reserved path, or reached
through a symlink, is refused): from there on it execs, as root, only /sbx/busybox of the
initramfs, so an input can replace nothing it runs. Its forked child becomes the sandbox
user itself (`become`: the container tier's steps) with the rlimits, loads the seccomp
filter and execs the command, stdout and stderr on their virtio-serial ports; the
command's environment (LD_* included) is never this root init's. It waits for the
command, writes `<exit status> <oom kills> <pids limit hits>` to the status port and
reboots (QEMU runs with -no-reboot: the VM ends).

A pooled guest's plan on the config share is a placeholder (`pooled`): this init loads
what every task's guest loads, says so on the agent port and reads the task's plan there
(guest_pool.py) before anything of the above; its inputs come in it (guest_inputs.py).
"""

import _signal as signal  # the C module: `signal` would import enum (and re) first
import marshal
import os
import resource
import sys
import time

RUN = "/sbx/run"
BUSYBOX = "/sbx/busybox"
CGROOT = "/sbx/cg"
# links vm-images/init makes to the virtio-serial ports QEMU names so
PORTS = {"stdout": "/sbx/port-stdout", "stderr": "/sbx/port-stderr", "status": "/sbx/port-status"}
# the agent port's number (microvm.AGENT_PORT_NR); vm-images/init links no port of that name
AGENT_NR = "p4"


def write(path, value, best_effort=True):
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
    except OSError:
        if not best_effort:
            raise


def bb(*args):
    rc = os.spawnv(os.P_WAIT, BUSYBOX, list(args))  # noqa: S606 - no shell on purpose
    if rc != 0:
        raise OSError(f"{' '.join(args)} failed ({rc})")


def ip(*args):
    bb("ip", *args)


def reserved_target(path, reserved):
    if not path.startswith("/") or path == "/" or "/../" in path + "/" or "/./" in path + "/":
        return True
    return any(path == r or path.startswith(r + "/") for r in reserved)


def mount_inputs(table, reserved):
    """The input table (`microvm.input_table`): `9p TAG PATH`, `bind SRC PATH`. Each target is
    created on the (briefly writable) root and must resolve to itself: no symlink of an
    earlier input may lead a mount onto a reserved path."""
    entries = []
    for line in table.splitlines():
        kind, a, path = line.split(" ", 2)
        if kind not in ("9p", "bind") or reserved_target(path, reserved):
            raise OSError(f"input target {path!r} refused")
        entries.append((kind, a, path))
    if not entries:
        return
    bb("mount", "-o", "remount,rw", "/")
    try:
        for kind, a, path in entries:
            # before anything is created: realpath resolves the missing part lexically
            if os.path.realpath(path) != path:
                raise OSError(f"input target {path!r} goes through a symlink")
            if kind == "9p" or os.path.isdir(a):  # (a claimed pooled guest binds trees)
                os.makedirs(path, 0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
                if not os.path.lexists(path):
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            if os.path.realpath(path) != path:
                raise OSError(f"input target {path!r} goes through a symlink")
            if kind == "9p":
                bb("mount", "-t", "9p", "-o", "trans=virtio,version=9p2000.L,msize=512000,"
                   "cache=loose,ro,nosuid,nodev", a, path)
            else:
                bb("mount", "-o", "bind", a, path)
                bb("mount", "-o", "remount,bind,ro,nosuid,nodev", path)
    finally:
        bb("mount", "-o", "remount,ro", "/")


def refresh(fresh, mac=True):
    """A guest restored from a snapshot shares its template's kernel random state, clock
    and MAC: the plan's seed is mixed in and the kernel's generator reseeded from it
    (RNDRESEEDCRNG) before anything draws from it, the clock set, the MAC (`mac`) too."""
    import fcntl  # a C extension: no Python-level imports behind it

    fd = os.open("/dev/urandom", os.O_WRONLY)
    try:
        os.write(fd, fresh["seed"])
        fcntl.ioctl(fd, 0x5207)  # RNDRESEEDCRNG = _IO('R', 0x07)
    finally:
        os.close(fd)
    time.clock_settime(time.CLOCK_REALTIME, fresh["clock"])
    if mac:
        ip("link", "set", "eth0", "address", fresh["mac"])


def network(net):
    ip("link", "set", "lo", "up")
    ip("addr", "add", f"{net['ip']}/{net['prefixlen']}", "dev", "eth0")
    ip("link", "set", "eth0", "up")
    ip("route", "add", "default", "via", net["gateway"], "dev", "eth0")


def make_cgroup():
    """The command's cgroup, no limits yet (a pooled guest makes it before its claim)."""
    write(f"{CGROOT}/cgroup.subtree_control", "+memory +pids +cpu", best_effort=False)
    d = f"{CGROOT}/task"
    os.mkdir(d)
    return d


def limit_cgroup(d, plan):
    """The profile's memory, pids and CPU limits (what the command itself may use: the VM
    has more), before the command runs; on the cgroup `d` made ahead, or on a new one."""
    d = make_cgroup() if d is None else d
    write(f"{d}/memory.max", str(plan["memory"]), best_effort=False)
    write(f"{d}/memory.swap.max", "0")
    write(f"{d}/pids.max", str(plan["pids"]), best_effort=False)
    write(f"{d}/cpu.max", plan["cpu_max"], best_effort=False)
    return d


def counter(path, key):
    try:
        with open(path) as fh:
            for line in fh:
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    except (OSError, ValueError):
        pass
    return 0


def end(status_fd, line):
    # no contextlib here: an import costs a lot under emulation
    try:  # noqa: SIM105
        os.write(status_fd, line.encode())
    except OSError:
        pass
    try:  # noqa: SIM105
        os.kill(-1, signal.SIGKILL)  # everything but pid 1
    except OSError:
        pass
    os.execv(BUSYBOX, ["reboot", "-f"])  # noqa: S606 - syncs, then reboot(2): the VM ends


PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECCOMP, PR_SET_DUMPABLE = 38, 24, 22, 4
SECCOMP_MODE_FILTER = 2
_LIBC = []  # (ctypes, libc, SockFprog), made once: a session's execs reuse them


def libc():
    """ctypes, libc and the sock_fprog type: ctypes is imported on the first call only
    (under emulation the import is slow; a session and a pooled guest import it early)."""
    if not _LIBC:
        import ctypes

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        import warnings  # noqa: F401 - os.execvpe's PATH search imports it: once, here

        _LIBC.append((ctypes, ctypes.CDLL(None, use_errno=True), SockFprog))
    return _LIBC[0]


def become(plan):
    """The sandbox user with nothing to regain: the twin of sandbox_init.become (each init
    is a standalone script): an empty capability bounding set, no supplementary groups,
    the uid and gid (leaving uid 0 clears the permitted, effective, ambient sets), NNP."""
    ctypes, lib, _ = libc()
    for cap in range(64):
        if lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    os.setgroups([])
    os.setresgid(plan["gid"], plan["gid"], plan["gid"])
    os.setresuid(plan["uid"], plan["uid"], plan["uid"])
    # not dumpable whatever fs.suid_dumpable says: its /proc/<pid>/mem and fds stay out of
    # the sandbox's reach while it waits outside the task's cgroup (the execve undoes it)
    if lib.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot clear dumpable")
    if lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot set no_new_privs")


def load_filter(bpf):
    """The plan's seccomp program (compiled by libseccomp on the host), for the command:
    the twin of sandbox_init.load_filter, loaded after no_new_privs, right before the
    exec."""
    ctypes, lib, sock_fprog = libc()
    if not bpf or len(bpf) % 8:
        raise OSError("the plan carries no seccomp filter")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = sock_fprog(len(bpf) // 8, ctypes.addressof(buf))
    if lib.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot load the seccomp filter")


def set_rlimits(plan):
    for name, value in plan["rlimits"].items():
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))


def child(plan, cg, fds, ctl=None, ahead=None, ready=None):
    """In the forked child: join the cgroup, take `fds` as stdio, become the sandbox user,
    load the filter and exec the command (no helper binary runs as root: an exec costs
    ~100 ms under emulation). A child forked ahead (`fork_child`) gets what it lacked on
    its pipe `ctl` (guest_agent `hand`): a pooled guest's command (no `plan`) its plan at
    the claim, being the sandbox user with the pool's rlimits (`ahead`) under the pool's
    filter already, said on `ready` (then `guest_pool.settled` moves it into the cgroup;
    only a plan with that very filter is handed, `guest_pool.keep_child`, and it refuses
    any other); a session's next exec its argv, env and cwd, under the filter."""
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        if ctl is None:  # a child forked ahead is moved in by its parent (`admit`)
            admit(cg, 0)
        pooled = plan is None
        set_rlimits(ahead if pooled else plan)
        if pooled:
            become(ahead)  # nothing of a task yet: a claim's child does not pay for it
            load_filter(ahead["seccomp"])  # the pool's: a claim's child does not pay either
            os.write(ready, b".")
            os.close(ready)
            plan = wire().receive(ctl)
            fds, ctl = (stdin_of(plan), *fds), None
        fds = fds if ctl is None else (*fds, ctl)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        os.closerange(len(fds), 1024)
        os.umask(0o022)
        if pooled and plan.get("seccomp") != ahead["seccomp"]:  # (keep_child hands none)
            raise OSError("the plan's seccomp filter is not the one loaded ahead")
        if not pooled:
            become(plan)
            load_filter(plan.get("seccomp"))
        if ctl is not None:
            plan = dict(plan, **wire().receive(3))
            os.close(3)
            if "fail" in plan:  # it could not be moved into the task's cgroup
                raise OSError(plan["fail"])
        os.chdir(plan["cwd"])  # as the sandbox user: its own view of its scratch
        # the command's environment comes with the plan: this init (root) never runs with
        # it, so the loader never applies the caller's LD_* to a root process
        os.execvpe(plan["argv"][0], plan["argv"], plan["env"])  # noqa: S606 - no shell
    except Exception as e:
        name = plan["argv"][0] if plan else "stockade-vm-init"
        os.write(2, f"stockade: {name}: {getattr(e, 'strerror', None) or e}\n".encode())
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


def admit(cg, pid):
    """Process `pid` (0: this one) into the command's cgroup `cg`; OSError when it cannot
    (its pids limit reached)."""
    write(f"{cg}/cgroup.procs", str(pid), best_effort=False)


def fork_child(plan, cg, fds, new_session=False, ahead=None):
    """A child that waits on a pipe (`child`'s `ctl`): (pid, the pipe's write end; with
    `ahead`, third, the read end of its `ready` pipe). It stays outside `cg` until its
    parent `admit`s it (what it does meanwhile is not charged to the task): before it is
    handed what it waits for, or once it said it is ready (a pooled guest's command)."""
    ctl_r, ctl_w = os.pipe()
    ready_r, ready_w = os.pipe() if ahead is not None else (None, None)
    pid = os.fork()
    if pid == 0:
        os.close(ctl_w)
        if ready_r is not None:
            os.close(ready_r)
        if new_session:
            os.setsid()
        child(plan, cg, fds, ctl_r, ahead, ready_w)
    os.close(ctl_r)
    if ready_r is None:
        return pid, ctl_w
    os.close(ready_w)
    return pid, ctl_w, ready_r


def sysctls(plan):
    write("/proc/sys/kernel/hostname", plan["hostname"], best_effort=False)
    write("/proc/sys/net/ipv4/ping_group_range", "0 2147483647")
    if plan.get("congestion_control"):
        write("/proc/sys/net/ipv4/tcp_congestion_control", plan["congestion_control"])


def stdin_of(plan):
    """The command's stdin: the plan's bytes (a pooled guest's), the copied file, or none."""
    if plan.get("stdin_data") is not None:
        fd = os.memfd_create("stdin", 0)
        view = memoryview(plan["stdin_data"])
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd
    return os.open(f"{RUN}/stdin" if plan["stdin"] else "/dev/null", os.O_RDONLY)


def image_checked():
    """The input table (`RUN/inputs`) of a current image (an older one neither locks the
    kernel down nor leaves the inputs to this init: refused). A pooled guest asks before
    its claim: the image and its table are the same for every task it could get."""
    with open("/proc/sys/kernel/modules_disabled") as fh:
        if fh.read().strip() != "1" or not os.path.exists(f"{RUN}/inputs"):
            raise OSError("the guest image is outdated: rebuild it with vm-images/build.sh")
    with open(f"{RUN}/inputs") as fh:
        return fh.read()


def inputs(plan, port, table):
    """The input table's (`image_checked`), then a claimed pooled guest's
    (guest_inputs.py), said on `port`; each checked by `mount_inputs`."""
    claim = plan.get("claim_inputs") if port is not None else None
    mount_inputs(table + (sys.modules["guest_inputs"].stage(claim, bb) if claim else ""),
                 plan["reserved"])
    if claim:
        os.write(port, sys.modules["guest_inputs"].INPUTS_READY)


def setup(status_fd, out_fd, err_fd):
    """The guest's network, names and inputs from the plan: (plan, the command's cgroup,
    its stdin, the agent port and waiting child of a pooled guest (whose stdin is then
    the child's to open)), or the guest's end with status 125."""
    port = cg = command = None
    try:
        with open(f"{RUN}/plan", "rb") as fh:
            plan = marshal.load(fh)  # noqa: S302 - written by the launcher; builtin, fast
        pooled = plan if plan.get("pooled") else None
        if pooled is not None:  # its wait for the claim (guest_pool.py, from the plan)
            load_modules(pooled["modules"])
            plan, port, cg, command, table = sys.modules["guest_pool"].claimed(
                sys.modules[__name__], pooled, out_fd, err_fd)
        if plan.get("fresh"):  # a pooled guest: reseeded again, its clock set again
            refresh(plan["fresh"], mac=pooled is None)
        if pooled is None:
            network(plan["net"])
            sysctls(plan)
        if plan["uid"] == 0 or plan["gid"] == 0:
            raise OSError("the command never runs as root")
        if pooled is None:
            table = image_checked()  # (a pooled guest checked its image before its claim)
            cg = limit_cgroup(cg, plan)
        in_fd = stdin_of(plan) if command is None else None
        inputs(plan, port, table)
    except Exception as e:
        os.write(err_fd, f"stockade-vm-init: {e}\n".encode())
        end(status_fd, "125 0 0\n")
    return plan, cg, in_fd, port, command


def reap(status_fd, pid, cg, limit):
    """As pid 1, reap every orphan; leave when the command ends; a command that keeps
    hitting its pids limit (a fork bomb) ends with its cgroup, as in the netns backend. It
    waits first: the command starts without this init's pids.events reads on the vCPU."""
    signal.sigtimedwait([signal.SIGCHLD], 0.05)
    while True:
        try:
            got, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            end(status_fd, "125 0 0\n")
        if got == pid:
            rc = 128 + os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
            ooms = counter(f"{cg}/memory.events", "oom_kill")
            pids = counter(f"{cg}/pids.events", "max")
            end(status_fd, f"{rc} {ooms} {pids}\n")
        if got == 0:
            if counter(f"{cg}/pids.events", "max") >= limit:
                write(f"{cg}/cgroup.kill", "1")
            signal.sigtimedwait([signal.SIGCHLD], 0.05)


def load_modules(sources):
    """The plan's guest modules (vmchannel, guest_agent: source text from the launcher's
    root-only config share) as importable modules; vm-images/init copies only this init."""
    for name, source in sources:
        if name in sys.modules:  # a pooled guest loaded them before its claim
            continue
        mod = type(sys)(name)
        exec(compile(source, f"{name}.py", "exec"), mod.__dict__)  # noqa: S102
        sys.modules[name] = mod


def agent_port():
    """The agent's virtio-serial port (AGENT_NR), root's alone before the sandbox runs."""
    names = [n for n in os.listdir("/dev") if n.startswith("vport") and n.endswith(AGENT_NR)]
    if len(names) != 1:
        raise OSError("no agent port in the guest")
    path = f"/dev/{names[0]}"
    os.chown(path, 0, 0)
    os.chmod(path, 0o600)
    return os.open(path, os.O_RDWR)


def exec_child(plan, cg):
    """A session's exec child (the agent's `fork`), stdio on fresh pipes, in a session of its
    own, waiting for argv, env and cwd (`child`): (pid, its pipe, the stdio's ends)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid, ctl = fork_child(plan, cg, (in_r, out_w, err_w), new_session=True)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return pid, ctl, (in_w, out_r, err_r)


def wire():
    """guest_agent (hand, receive): loaded from the plan by every guest whose children
    wait on a pipe (sessions, probes, pooled guests)."""
    return sys.modules["guest_agent"]


def session(plan, cg, status_fd, err_fd, port):
    """Serve execs over the agent port (`port`: opened already, or None) until the launcher
    closes it."""
    serve_agent(plan, cg, status_fd, err_fd, port)
    end(status_fd, "0 0 0\n")


def probes_first(plan, cg, status_fd, err_fd, port):
    """The fence self-test's execs (before a one-shot command): served until the launcher
    closes the agent's port, then the agent's signal handling is undone for reap()."""
    serve_agent(plan, cg, status_fd, err_fd, port)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])


def serve_agent(plan, cg, status_fd, err_fd, port):
    try:
        port = agent_port() if port is None else port
        load_modules(plan["modules"])
        libc()  # once here, not in every exec's child

        import guest_agent
        agent = guest_agent.Agent(
            port, lambda: exec_child(plan, cg),
            lambda: (counter(f"{cg}/memory.events", "oom_kill"),
                     counter(f"{cg}/pids.events", "max")),
            lambda: write(f"{cg}/cgroup.kill", "1"), plan["pids_fail_kill"],
            lambda pid: admit(cg, pid))
    except Exception as e:
        os.write(err_fd, f"stockade-vm-init: {e}\n".encode())
        end(status_fd, "125 0 0\n")
    agent.serve()
    os.close(port)


def main():
    # SIGCHLD blocked: the wait loop sleeps in sigtimedwait until a child changes state
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    status_fd = os.open(PORTS["status"], os.O_WRONLY)
    out_fd = os.open(PORTS["stdout"], os.O_WRONLY)
    err_fd = os.open(PORTS["stderr"], os.O_WRONLY)
    plan, cg, in_fd, port, command = setup(status_fd, out_fd, err_fd)
    if plan.get("session"):
        if in_fd is not None:
            os.close(in_fd)
        if command is not None:
            os.close(command[1])  # the pooled command's child leaves (`receive`)
        session(plan, cg, status_fd, err_fd, port)
    if plan.get("probe_first"):
        probes_first(plan, cg, status_fd, err_fd, port)
    # a pooled command's child is in the cgroup already (guest_pool.settled)
    if command is not None and wire().hand(command[1], dict(plan, modules=())):
        pid = command[0]
    else:  # a cold start's command, or a pooled one whose child is gone
        in_fd = stdin_of(plan) if in_fd is None else in_fd
        pid = os.fork()
        if pid == 0:
            child(plan, cg, (in_fd, out_fd, err_fd))
        os.close(in_fd)
    for fd in (out_fd, err_fd):
        os.close(fd)
    reap(status_fd, pid, cg, plan["pids_fail_kill"])


main()
