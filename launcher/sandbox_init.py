"""The sandbox's init (pid 1 of its pid namespace), run by the host's Python with `-I -S`.

Hand-written and stdlib-only because it runs before the sandbox's root exists: it reads a
list of operations (built and unit-tested in `initscript.py`) from the file descriptor named
by argv[1] (a memfd, marshal format), performs them with
mount(2)/pivot_root(2) directly (dozens of mount(8) processes cost >100 ms per sandbox),
then starts the command as an unprivileged user with an empty capability bounding set,
no_new_privs and the seccomp filter of the plan (BPF compiled by libseccomp on the host,
`seccomp_bpf.py`; loaded last, so the init's own mounts are done by then), waits for it
and exits with its status (128+N when a signal ended it).
Nothing from the plan reaches argv, so /proc/1/cmdline shows no host paths. The launcher
passes this file's code compiled inside the plan (a small bootstrap runs it with the plan
as PLAN), or where that cannot be had, this source itself.

A session's init gets no command: it holds the sandbox (reaping orphans) until it is
killed. The session's exec server is this same file with a plan that carries `join` (the
init's pid, the sandbox's cgroups) and `serve` (its socket): it joins the cgroups and the
init's namespaces once, and for each exec makes a pid namespace of its own below the
sandbox's (a kill of the exec ends exactly its processes) and starts the command through
the same `start_command` as the first command (uid, capabilities, no_new_privs, rlimits,
seccomp, environment).
"""

import ctypes
import marshal
import os
import resource
import selectors
import signal
import socket
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, 155)
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, BPF_INSN = 22, 2, 8
PR_SET_PDEATHSIG, CLONE_NEWPID, PR_SET_NAME = 1, 0x20000000, 15
HELD_NAME = b"stockade-held"  # the session init's name once it holds (the launcher waits)
# the init's namespaces an exec joins; mnt last (it changes what /proc/<pid> means)
JOIN_NS = ("ipc", "uts", "net", "pid", "mnt")

libc = ctypes.CDLL(None, use_errno=True)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src, target, fstype, flags, data):
    check(libc.mount(src.encode() if src else None, target.encode(),
                     fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                     data.encode() if data else None), f"mount {target}")


def op_cgroup(op):
    for path in op[1]:
        with open(path, "w") as fh:
            fh.write("0")  # "0" is the writer itself


def op_write(op):  # [write, path, text, best_effort]
    try:
        with open(op[1], "w") as fh:
            fh.write(op[2])
    except OSError:
        if not op[3]:
            raise


def op_mount(op):
    mount(op[1], op[2], op[3], op[4], op[5])


def op_bind(op):  # [bind, src, target, read_only, only_if_target_exists]
    if op[4] and not os.path.exists(op[2]):
        return
    mount(op[1], op[2], None, MS_BIND, None)
    if op[3]:
        mount(None, op[2], None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
              None)


def op_remount_ro(op):
    mount(None, op[1], None, MS_REMOUNT | MS_RDONLY | op[2], None)


def op_mkdir(op):
    os.makedirs(op[1], mode=op[2], exist_ok=True)


def op_touch(op):
    os.makedirs(os.path.dirname(op[1]), exist_ok=True)
    os.close(os.open(op[1], os.O_WRONLY | os.O_CREAT, 0o644))


def op_symlink(op):
    os.symlink(op[1], op[2])


def op_pivot(op):
    os.chdir(op[1])
    check(libc.syscall(SYS_PIVOT_ROOT, b".", op[2].encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/" + op[2].encode(), MNT_DETACH), "umount old root")
    os.rmdir("/" + op[2])


def op_confined(op):  # [confined, path, root]: path resolves to itself under root
    want = os.path.realpath(op[2]) + op[1][len(op[2]):]
    if os.path.realpath(op[1]) != want:
        raise OSError(f"input target {op[1][len(op[2]):]} goes through a symlink")


def op_chdir(op):
    os.chdir(op[1])


OPS = {"cgroup": op_cgroup, "write": op_write, "mount": op_mount, "bind": op_bind,
       "remount_ro": op_remount_ro, "mkdir": op_mkdir, "touch": op_touch,
       "symlink": op_symlink, "pivot": op_pivot, "confined": op_confined, "chdir": op_chdir}


def do(op):
    run = OPS.get(op[0])
    if run is None:
        raise ValueError(f"unknown init operation {op[0]!r}")
    run(op)


def become(uid, gid, rlimits):
    for name, value in rlimits.items():
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("0")
    except OSError:
        pass
    for cap in range(64):  # empty bounding set: nothing can ever regain a capability
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # leaving uid 0 clears permitted/effective/ambient caps
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def load_filter(bpf):
    """The plan's seccomp program as libseccomp compiled it; none means no start."""
    if not bpf or len(bpf) % BPF_INSN:
        raise OSError("the plan carries no seccomp filter")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // BPF_INSN, ctypes.addressof(buf))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0),
          "seccomp filter")


def execvp(argv, env):
    """PATH search by hand: os.execvp imports modules the new root no longer has."""
    if "/" in argv[0]:
        os.execve(argv[0], argv, env)  # noqa: S606 - no shell on purpose
    err = FileNotFoundError(2, "command not found")
    for d in env.get("PATH", "/usr/bin:/bin").split(":"):
        try:
            os.execve(os.path.join(d or ".", argv[0]), argv, env)  # noqa: S606 - no shell
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError as e:
            err = e
    raise err


def status_of(status):
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def reap_until(pid):
    """As an init, reap every orphan; the exit status of `pid` once it ends."""
    while True:
        try:
            got, status = os.wait()
        except ChildProcessError:
            return 1
        if got == pid:
            return status_of(status)


def hold():
    """A session's init: no command, reap orphans until killed (SIGCHLD blocked and
    waited for, so no orphan can end between a reap and the wait). Its new name tells
    the launcher that the plan is done: from now on an exec may join it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    check(libc.prctl(PR_SET_NAME, HELD_NAME, 0, 0, 0), "name")
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        signal.sigwaitinfo({signal.SIGCHLD})


def start_command(plan, argv, umask, cwd=None):
    """Fork the command as the sandbox user (the same steps for the first command and
    every exec); reap until it ends and exit with its status."""
    pid = os.fork()
    if pid == 0:
        try:
            os.umask(umask)
            become(plan["uid"], plan["gid"], plan.get("rlimits", {}))
            if cwd is not None:  # as the sandbox user: its own view of its scratch
                os.chdir(cwd)
            load_filter(plan.get("seccomp"))  # after no_new_privs, right before the exec
            # the command's environment comes with the plan: this init (root) never runs
            # with it, so the loader never applies the caller's LD_* to a root process
            execvp(argv, plan.get("env", dict(os.environ)))
        except Exception as e:
            os.write(2, f"stockade: {argv[0]}: {getattr(e, 'strerror', None) or e}\n".encode())
            os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    os._exit(reap_until(pid))


def fork_tied():
    """fork(); the child dies with its parent (SIGKILL). A pipe, not getppid(), tells
    whether the parent died before the prctl: across a pid namespace getppid() is 0.
    The parent gets (pid, the pipe's write end: held while the child may start)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(r)
        return pid, w
    os.close(w)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    os.set_blocking(r, False)
    try:
        if os.read(r, 1) == b"":  # every write end closed: the parent is gone
            os._exit(137)
    except BlockingIOError:
        pass
    os.close(r)
    return 0, None


def join(target, cgroup_procs):
    """Join the sandbox's cgroups (host paths: before the mount namespace), then the
    namespaces of its init `target`."""
    op_cgroup(["cgroup", cgroup_procs])
    fds = [os.open(f"/proc/{target}/ns/{n}", os.O_RDONLY) for n in JOIN_NS]
    for fd in fds:
        check(libc.setns(fd, 0), "setns")
        os.close(fd)


def start_exec(plan, argv, umask, cwd, before=None):
    """The exec's first child, in the sandbox's pid namespace (`before` runs in it
    first): it makes the exec's own pid namespace, whose pid 1 starts the command; the
    end of that pid 1 kills every process of the exec and nothing else."""
    outer, tie = fork_tied()
    if outer == 0:
        if before is not None:
            before()
        check(libc.unshare(CLONE_NEWPID), "unshare")
        inner, _ = fork_tied()
        if inner == 0:
            start_command(plan, argv, umask, cwd)
        os._exit(reap_until(inner))
    return outer, tie


def exec_server(plan, umask):
    """A session's exec server: the cgroups and namespaces joined once, then one exec
    per request on the launcher's socket (argv, environment, cwd, and the exec's stdin,
    stdout and stderr as fds); it answers each exec's pid and, later, its status."""
    join(plan["join"]["pid"], plan["join"]["cgroup_procs"])
    sock = socket.socket(fileno=plan["serve"])
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    running = {}  # pidfd -> (request id, pid, the tie's write end)
    while True:
        for key, _ in sel.select():
            if key.fileobj is not sock:
                rid, pid, tie = running.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                os.close(tie)
                sock.send(marshal.dumps(("exit", rid, status_of(os.waitpid(pid, 0)[1]))))
            elif not serve_request(sock, sel, running, plan, umask):
                os._exit(0)  # the launcher closed its end: the session is over


def serve_request(sock, sel, running, plan, umask):
    msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 3)
    if not msg:
        return False
    req = marshal.loads(msg)  # noqa: S302 - the launcher's
    if "kill" in req:
        for pid in [p for rid, p, _ in running.values() if rid == req["kill"]]:
            os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still this child's
        return True

    def stdio():  # in the child: the exec's pipes become 0, 1, 2
        sock.close()
        sel.close()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in fds:
            if fd > 2:
                os.close(fd)

    pid, tie = start_exec({**plan, "env": req["env"]}, req["argv"], umask, req["cwd"], stdio)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    running[pidfd] = (req["id"], pid, tie)
    sel.register(pidfd, selectors.EVENT_READ)
    sock.send(marshal.dumps(("started", req["id"], pid)))
    return True


def main():
    plan = globals().get("PLAN")  # read by the bootstrap that ran this file's code
    if plan is None:
        with os.fdopen(int(sys.argv[1]), "rb") as fh:
            plan = marshal.loads(fh.read())  # noqa: S302 - the launcher's; builtin, fast
    # the new root's directories (/etc and its parents among them) get their modes whatever
    # the launcher's umask; the command gets the launcher's umask back
    umask = os.umask(0o022)
    argv = sys.argv[2:]
    try:
        if "serve" in plan:
            exec_server(plan, umask)
        for op in plan["ops"]:
            do(op)
    except OSError as e:
        os.write(2, f"stockade-init: {e.strerror or e}\n".encode())
        os._exit(125)
    if not argv:
        hold()
    start_command(plan, argv, umask)


main()
