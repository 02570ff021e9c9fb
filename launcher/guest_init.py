"""The microVM guest's init (pid 1 after vm-images/init), run by the host's Python from the
read-only /usr share with `-I -S`. The launcher copies it onto the config share.

Only builtin modules (and `resource`): every import is read over 9p and run under
emulation when the host has no KVM, where `json`, `ctypes` or `signal` (enum, re, ...)
cost a second. vm-images/init has already built the filesystem, copied the plan to
/sbx/run, unmounted the config share and made the root read-only.

It reads the plan (`microvm.guest_plan`, marshal: the values are data, never parsed as
shell), sets up eth0 with the sandbox's address (busybox `ip`, argument lists), puts the
command in a cgroup with the profile's memory and pids limits, opens the host's util-linux
`setpriv`, and only then mounts the inputs (their table from the config share; a target
at or under a reserved path, or one reached through a symlink, is refused): from there on
it execs, as root, only the opened setpriv (fexecve) and /sbx/busybox of the initramfs,
so an input can replace nothing it runs. setpriv starts the command as the unprivileged
sandbox user (no supplementary groups, empty capability bounding set, no_new_privs) with
the rlimits, under the container tier's seccomp filter (loaded just before setpriv, which
needs none of the calls it denies), its stdout and stderr on their virtio-serial ports;
loader variables (LD_*) reach the command through `env`, run after the drop, never setpriv
itself. It waits for the command, writes `<exit status> <oom kills> <pids limit hits>` to
the status port and reboots (QEMU runs with -no-reboot: the VM ends).
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
            if kind == "9p":
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


def refresh(fresh):
    """A guest restored from a snapshot shares its template's kernel random state, clock
    and MAC: the plan's seed is mixed in and the kernel's generator reseeded from it
    (RNDRESEEDCRNG) before anything else draws from it, the clock set, the MAC changed."""
    import fcntl  # a C extension: no Python-level imports behind it

    fd = os.open("/dev/urandom", os.O_WRONLY)
    try:
        os.write(fd, fresh["seed"])
        fcntl.ioctl(fd, 0x5207)  # RNDRESEEDCRNG = _IO('R', 0x07)
    finally:
        os.close(fd)
    time.clock_settime(time.CLOCK_REALTIME, fresh["clock"])
    ip("link", "set", "eth0", "address", fresh["mac"])


def network(net):
    ip("link", "set", "lo", "up")
    ip("addr", "add", f"{net['ip']}/{net['prefixlen']}", "dev", "eth0")
    ip("link", "set", "eth0", "up")
    ip("route", "add", "default", "via", net["gateway"], "dev", "eth0")


def command_cgroup(plan):
    """A cgroup with the profile's memory and pids limits (the VM's RAM has headroom for the
    guest kernel; this is what the command itself may use)."""
    write(f"{CGROOT}/cgroup.subtree_control", "+memory +pids", best_effort=False)
    d = f"{CGROOT}/task"
    os.mkdir(d)
    write(f"{d}/memory.max", str(plan["memory"]), best_effort=False)
    write(f"{d}/memory.swap.max", "0")
    write(f"{d}/pids.max", str(plan["pids"]), best_effort=False)
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


def load_filter(bpf):
    """The plan's seccomp program (compiled by libseccomp on the host), for setpriv and the
    command. The twin of sandbox_init.load_filter (each init is a standalone script);
    ctypes is imported here only, in the child: under emulation the import is slow."""
    import ctypes

    if not bpf or len(bpf) % 8:
        raise OSError("the plan carries no seccomp filter")

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.addressof(buf))
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
        raise OSError(ctypes.get_errno(), "cannot load the seccomp filter")


def child(plan, cg, fds, setpriv_fd):
    """In the forked child: join the cgroup, take the ports as stdio, drop to the sandbox
    user through the setpriv opened before the inputs were mounted and run the command
    (setpriv searches PATH of `env`)."""
    in_fd, out_fd, err_fd = fds
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        write(f"{cg}/cgroup.procs", "0", best_effort=False)
        for name, value in plan["rlimits"].items():
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
        os.dup2(in_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.closerange(3, setpriv_fd)  # setpriv_fd is close-on-exec: the command never has it
        os.closerange(setpriv_fd + 1, 1024)
        os.umask(0o022)
        os.chdir(plan["cwd"])
        # the dynamic loader honours LD_* (LD_PRELOAD...) in setpriv, which runs as root:
        # they go to the command through `env`, exec'd after the drop
        env = {k: v for k, v in plan["env"].items() if not k.startswith("LD_")}
        loader = [f"{k}={v}" for k, v in plan["env"].items() if k.startswith("LD_")]
        argv = [plan["env_bin"], *loader, *plan["argv"]] if loader else plan["argv"]
        load_filter(plan.get("seccomp"))  # last: nothing but the exec runs under it as root
        os.execve(setpriv_fd, [  # noqa: S606 - no shell on purpose
            "setpriv", f"--reuid={plan['uid']}", f"--regid={plan['gid']}", "--clear-groups",
            "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--", *argv,
        ], env)
    except Exception as e:
        os.write(2, f"stockade: {plan['argv'][0]}: {getattr(e, 'strerror', None) or e}\n"
                 .encode())
        os._exit(126)


def setup(status_fd, err_fd):
    """The guest's network, names and inputs from the plan; (plan, the command's cgroup,
    its stdin, setpriv) or the end of the guest with status 125."""
    try:
        with open(f"{RUN}/plan", "rb") as fh:
            plan = marshal.load(fh)  # noqa: S302 - written by the launcher; builtin, fast
        if plan.get("fresh"):
            refresh(plan["fresh"])
        network(plan["net"])
        write("/proc/sys/kernel/hostname", plan["hostname"], best_effort=False)
        write("/proc/sys/net/ipv4/ping_group_range", "0 2147483647")
        if plan.get("congestion_control"):
            write("/proc/sys/net/ipv4/tcp_congestion_control", plan["congestion_control"])
        if plan["uid"] == 0 or plan["gid"] == 0:
            raise OSError("the command never runs as root")
        # an image built by an older vm-images/init neither locks the kernel down nor
        # leaves the inputs to this init: refuse it rather than run with less
        with open("/proc/sys/kernel/modules_disabled") as fh:
            if fh.read().strip() != "1" or not os.path.exists(f"{RUN}/inputs"):
                raise OSError("the guest image is outdated: rebuild it with vm-images/build.sh")
        cg = command_cgroup(plan)
        in_fd = os.open(f"{RUN}/stdin" if plan["stdin"] else "/dev/null", os.O_RDONLY)
        # opened before any input exists in the guest (os.open: close-on-exec)
        setpriv_fd = os.open(plan["setpriv"], os.O_RDONLY)
        with open(f"{RUN}/inputs") as fh:
            mount_inputs(fh.read(), plan["reserved"])
    except Exception as e:
        os.write(err_fd, f"stockade-vm-init: {e}\n".encode())
        end(status_fd, "125 0 0\n")
    return plan, cg, in_fd, setpriv_fd


def reap(status_fd, pid, cg, limit):
    """As pid 1, reap every orphan; leave when the command ends. Like the netns backend, a
    command that keeps hitting its pids limit (a fork bomb) is ended: the whole cgroup."""
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
        mod = type(sys)(name)
        exec(compile(source, f"{name}.py", "exec"), mod.__dict__)  # noqa: S102
        sys.modules[name] = mod


def agent_port():
    """The agent's virtio-serial port (number AGENT_NR of the one virtio-serial device),
    made root's alone before anything of the sandbox runs."""
    names = [n for n in os.listdir("/dev") if n.startswith("vport") and n.endswith(AGENT_NR)]
    if len(names) != 1:
        raise OSError("no agent port in the guest")
    path = f"/dev/{names[0]}"
    os.chown(path, 0, 0)
    os.chmod(path, 0o600)
    return os.open(path, os.O_RDWR)


def spawn(plan, cg, setpriv_fd, req):
    """One exec of a session: the first command's start with the request's argv, env and
    cwd, its stdio on fresh pipes, in a session of its own (a signal reaches its group)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        child(dict(plan, argv=req["argv"], env=req["env"], cwd=req["cwd"]), cg,
              (in_r, out_w, err_w), setpriv_fd)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return pid, in_w, out_r, err_r


def session(plan, cg, setpriv_fd, status_fd, err_fd):
    """Serve execs over the agent port until the launcher closes it."""
    serve_agent(plan, cg, setpriv_fd, status_fd, err_fd)
    end(status_fd, "0 0 0\n")


def probes_first(plan, cg, setpriv_fd, status_fd, err_fd):
    """The fence self-test's execs (before a one-shot command): served until the launcher
    closes the agent's port, then the agent's signal handling is undone for reap()."""
    serve_agent(plan, cg, setpriv_fd, status_fd, err_fd)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])


def serve_agent(plan, cg, setpriv_fd, status_fd, err_fd):
    try:
        port = agent_port()
        load_modules(plan["modules"])
        import ctypes  # noqa: F401 - once here, not in every exec's child (see load_filter)

        import guest_agent
        agent = guest_agent.Agent(
            port, lambda req: spawn(plan, cg, setpriv_fd, req),
            lambda: (counter(f"{cg}/memory.events", "oom_kill"),
                     counter(f"{cg}/pids.events", "max")),
            lambda: write(f"{cg}/cgroup.kill", "1"), plan["pids_fail_kill"])
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
    plan, cg, in_fd, setpriv_fd = setup(status_fd, err_fd)
    if plan.get("session"):
        os.close(in_fd)
        session(plan, cg, setpriv_fd, status_fd, err_fd)
    if plan.get("probe_first"):
        probes_first(plan, cg, setpriv_fd, status_fd, err_fd)
    pid = os.fork()
    if pid == 0:
        child(plan, cg, (in_fd, out_fd, err_fd), setpriv_fd)
    for fd in (in_fd, out_fd, err_fd, setpriv_fd):
        os.close(fd)
    reap(status_fd, pid, cg, plan["pids_fail_kill"])


main()
