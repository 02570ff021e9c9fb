"""The microVM guest agent: a session guest's pid 1 (after guest_init.py's setup) serving the
launcher's execs over ONE virtio-serial port (frames of `vmchannel`).

The port is no network port: its device node is root's alone (0600) and the agent runs as
the guest's root, outside the sandbox user and its cgroup; the sandbox's code cannot open
it (tests/launcher/test_microvm_session.py proves it). guest_init.py loads this module from
the plan (the launcher's trusted, root-only config share) and hands it `spawn`, which starts
one command exactly as the first command of a one-shot guest starts (the sandbox uid, empty
bounding set, no_new_privs, the seccomp filter, rlimits, the task's cgroup).

One thread, one poll loop: the port, each exec's stdout/stderr pipes and its stdin while
bytes are pending, and SIGCHLD through the signal wakeup fd. Like guest_init.py it imports
only builtin modules and `select` (one C extension: no Python-level imports behind it).
"""

import _signal as signal
import marshal
import os
import select
import time

import vmchannel as ch

# an exec whose process ended while a background child still holds its pipes: its exit is
# reported this long after (what arrived until then is sent first)
LINGER_S = 0.2
READ = select.POLLIN | select.POLLHUP | select.POLLERR


class Exec:
    __slots__ = ("base", "chan", "eof", "exited_at", "in_fd", "outs", "pending", "pid",
                 "status")

    def __init__(self, chan, pid, fds, base):
        self.chan, self.pid, self.base = chan, pid, base
        self.in_fd, out_fd, err_fd = fds
        self.outs = {out_fd: ch.STDOUT, err_fd: ch.STDERR}
        self.pending = bytearray()
        self.eof = False
        self.status = None
        self.exited_at = 0.0


def check_request(req):
    """The EXEC payload's fields, or ValueError: argv a non-empty list of strings, env a
    dict of strings, cwd beneath /scratch once resolved (the launcher checked them; the
    agent runs as root and checks again)."""
    argv, env, cwd = req.get("argv"), req.get("env"), req.get("cwd", "/scratch")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv must be a non-empty list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        raise ValueError("env must map strings to strings")
    real = os.path.realpath(cwd) if isinstance(cwd, str) else ""
    if real != "/scratch" and not real.startswith("/scratch/"):
        raise ValueError(f"cwd {cwd!r} is not beneath /scratch")
    return {"argv": argv, "env": env, "cwd": real, "stdin": bool(req.get("stdin"))}


def hand(fd, message):
    """`message` (a marshal dict after its 4-byte length) to a child waiting on its pipe
    (`receive`), then the pipe's end; False when the child is gone."""
    blob = marshal.dumps(message, 4)
    try:
        view = memoryview(len(blob).to_bytes(4, "big") + blob)
        while view:
            view = view[os.write(fd, view):]
        return True
    except OSError:  # BrokenPipeError: Python ignores SIGPIPE
        return False
    finally:
        os.close(fd)


def receive(fd):
    """In a child forked ahead: what `hand` sent; at the pipe's end before anything (the
    child was not needed) it leaves."""
    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        chunk = os.read(fd, 65536)
        if not chunk:
            if not data:
                os._exit(0)
            raise OSError("the pipe ended inside a message")
        data += chunk
    return marshal.loads(data[4:])  # noqa: S302 - from this guest's root init


class Agent:
    """`fork() -> (pid, its pipe, (stdin fd, stdout fd, stderr fd))`: an exec's child, its
    request still to come on its pipe (`hand`); `admit(pid)` moves it into the task's
    cgroup (OSError when it cannot: at its pids limit); `seen() -> (oom kills, pids limit
    hits)` of the task's cgroup; `kill_all()` ends every process in it.

    One child is forked ahead whenever no exec's process runs (before the agent waits), so
    an exec pays no fork of the init's Python, privilege drop or filter load (~20 ms under
    emulation, more under load). It is the task's user's, under its filter, but joins the
    task's cgroup only when an exec takes it (`admitted`): its start, this agent's work, is
    not charged to the task's CPU quota. A fork-bomb kill drops it; an exec then forks
    afresh."""

    def __init__(self, port, fork, seen, kill_all, pids_fail_kill, admit):
        self.port, self.fork, self.seen, self.kill_all = port, fork, seen, kill_all
        self.admit = admit
        self.pids_fail_kill = pids_fail_kill
        self.warm = None  # the child forked ahead
        self.dec = ch.Decoder(ch.HOST_TYPES)
        self.poll = select.poll()
        self.execs = {}  # channel -> Exec
        self.by_pid = {}
        self.by_fd = {}  # pipe fd -> Exec
        self.killed_at = 0  # the pids.events count at the last fork-bomb kill
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
        self.poll.register(self.port, READ)
        self.poll.register(self.wake_r, READ)

    def send(self, chan, kind, payload=b""):
        frame = ch.encode(chan, kind, payload)
        view = memoryview(frame)
        while view:
            view = view[os.write(self.port, view):]

    def serve(self):
        """Until the host's end of the port closes (or breaks the framing)."""
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        self.send(0, ch.READY, b"exec")
        while True:
            busy = any(e.status is None for e in self.execs.values())
            lingering = any(e.status is not None for e in self.execs.values())
            timeout = 50 if lingering else 100 if busy else None
            if not busy:
                self.fork_ahead()
            for fd, ev in self.poll.poll(timeout):
                if fd == self.port:
                    if not self.from_host():
                        self.drop_warm()
                        return
                elif fd == self.wake_r:
                    while True:
                        try:
                            if not os.read(self.wake_r, 512):
                                break
                        except BlockingIOError:
                            break
                elif fd in self.by_fd:
                    self.pipe_ready(fd, ev)
            self.reap()
            self.check_pids()
            self.finish_ended()

    def from_host(self):
        data = os.read(self.port, 256 * 1024)
        if not data:
            return False
        try:
            frames = self.dec.feed(data)
        except ch.ChannelError:
            return False
        for chan, kind, payload in frames:
            if kind == ch.EXEC:
                self.start(chan, payload)
            elif chan in self.execs:
                self.to_exec(self.execs[chan], kind, payload)
        return True

    def start(self, chan, payload):
        if chan == 0 or chan in self.execs:
            self.send(chan, ch.ERROR, b"channel in use")
            return
        try:
            req = check_request(marshal.loads(payload))  # noqa: S302 - the launcher's
        except (ValueError, EOFError, TypeError) as e:
            self.send(chan, ch.ERROR, str(e).encode("utf-8", "replace"))
            return
        pid, in_fd, out_fd, err_fd = self.spawn(req)
        e = Exec(chan, pid, (in_fd, out_fd, err_fd), self.seen())
        self.execs[chan], self.by_pid[pid] = e, e
        for fd in (in_fd, out_fd, err_fd):
            os.set_blocking(fd, False)
            self.by_fd[fd] = e
        for fd in e.outs:
            self.poll.register(fd, READ)
        if not req["stdin"]:
            self.close_stdin(e)

    def spawn(self, req):
        """(pid, stdin, stdout, stderr) of the child forked ahead given `req`, or of a fresh
        one when that one is gone."""
        request = {"argv": req["argv"], "env": req["env"], "cwd": req["cwd"]}
        if self.warm is not None:
            (pid, ctl, fds), self.warm = self.warm, None
            if hand(ctl, self.admitted(pid, request)):
                return (pid, *fds)
            for fd in fds:
                os.close(fd)
        pid, ctl, fds = self.fork()
        # a child that failed before says why on its stderr and exits
        hand(ctl, self.admitted(pid, request))
        return (pid, *fds)

    def admitted(self, pid, request):
        """`request`, the child `pid` being in the task's cgroup now; else the reason it
        fails with instead (guest_init `child`): no command runs outside that cgroup."""
        try:
            self.admit(pid)
        except OSError as e:
            return {"argv": request["argv"],
                    "fail": f"cannot join the task's cgroup: {e.strerror or e}"}
        return request

    def fork_ahead(self):
        if self.warm is None:
            try:  # noqa: SIM105 - no contextlib: an import costs a lot under emulation
                self.warm = self.fork()
            except OSError:  # none ahead: the exec's own fork says why
                pass

    def drop_warm(self):
        """The child forked ahead leaves (`receive` sees its pipe's end)."""
        if self.warm is not None:
            (_, ctl, fds), self.warm = self.warm, None
            for fd in (ctl, *fds):
                os.close(fd)

    def to_exec(self, e, kind, payload):
        if kind == ch.SIGNAL:
            try:  # noqa: SIM105 - no contextlib: an import costs a lot under emulation
                os.killpg(e.pid, int(payload))
            except (ValueError, OSError):
                pass
        elif kind == ch.STDIN and e.in_fd is not None:
            if payload:
                e.pending += payload
                self.poll.register(e.in_fd, select.POLLOUT)
            else:
                e.eof = True
                if not e.pending:
                    self.close_stdin(e)

    def close_stdin(self, e):
        if e.in_fd is not None:
            try:  # noqa: SIM105 - no contextlib: an import costs a lot under emulation
                self.poll.unregister(e.in_fd)
            except KeyError:
                pass
            self.by_fd.pop(e.in_fd, None)
            os.close(e.in_fd)
            e.in_fd, e.pending = None, bytearray()

    def pipe_ready(self, fd, ev):
        e = self.by_fd[fd]
        if fd == e.in_fd:
            try:
                del e.pending[:os.write(fd, e.pending)]
            except BlockingIOError:
                return
            except OSError:  # the command closed its stdin
                self.close_stdin(e)
                return
            if not e.pending:
                if e.eof:
                    self.close_stdin(e)
                else:
                    self.poll.unregister(fd)
            return
        try:
            data = os.read(fd, ch.CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.send(e.chan, e.outs[fd], data)
        else:
            self.close_output(e, fd)

    def close_output(self, e, fd):
        self.poll.unregister(fd)
        self.by_fd.pop(fd, None)
        del e.outs[fd]
        os.close(fd)

    def reap(self):
        """Every child that ended (pid 1 reaps orphans too)."""
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            e = self.by_pid.pop(pid, None)
            if e is not None:
                e.status = 128 + os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
                e.exited_at = time.monotonic()

    def check_pids(self):
        # as in a one-shot guest: a command that keeps hitting the pids limit (a fork bomb)
        # ends, here with every process of the task's cgroup (the agent is outside it)
        hits = self.seen()[1]
        if self.execs and hits - self.killed_at >= self.pids_fail_kill:
            self.killed_at = hits
            self.kill_all()
            self.drop_warm()  # killed with the rest: the next exec forks afresh

    def finish_ended(self):
        now = time.monotonic()
        for e in [e for e in self.execs.values() if e.status is not None]:
            if e.outs and now - e.exited_at < LINGER_S:
                continue
            for fd in list(e.outs):
                self.close_output(e, fd)
            self.close_stdin(e)
            ooms, pids = self.seen()
            self.send(e.chan, ch.EXIT, ch.exit_text(e.status, ooms - e.base[0],
                                                   pids - e.base[1]))
            del self.execs[e.chan]
