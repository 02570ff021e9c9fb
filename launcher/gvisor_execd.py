"""A gVisor session's exec server (runs inside the sandbox from `python3 -I -S -c`, one per
session, started by one `runsc exec`; stdlib only). The host end is gvisor_exec.py.

Why: a `runsc exec` per command costs a runsc start (~35-45 ms here) and its kill ended
only the exec's first process (a forked grandchild lived on). Here each exec is a vfork
(`subprocess.Popen`, no preexec: ~5 ms in the Sentry) into a pid namespace of its own
(`unshare(CLONE_NEWPID)` before each spawn): the command is that namespace's pid 1, so a
SIGKILL of it ends every process of the exec and nothing else, as the container tier's
execs end.

Identity: runsc starts it as root with CAP_SYS_ADMIN, CAP_SETUID, CAP_SETGID and
CAP_SETPCAP (the container's rlimits and no_new_privs); it empties its bounding set, takes
the sandbox's uid and gid (keeping only CAP_SYS_ADMIN, for the unshare) and checks the
result before it serves. A command it starts is then exactly the first command's: a
non-root execve with no file capabilities (no_new_privs) and no ambient set leaves no
capability, the bounding set is empty, uid/gid/groups are the sandbox's.

Wire (stdin from the host, stdout to it): frames of `>IBI` (exec id, kind, length) and a
payload. Host -> server: S start (marshal {argv, env, cwd, stdin}), I stdin bytes, E stdin
EOF, K kill. Server -> host: P started (the pid, ascii, in the sandbox's pid namespace), O
stdout, R stderr, X exit (ascii: the status, 128+N for signal N) once the command ended
and both its pipes closed. EOF on stdin ends the server.
"""

import ctypes
import fcntl
import marshal
import os
import selectors
import signal
import struct
import subprocess

HEADER = struct.Struct(">IBI")
MAX_FRAME = 1 << 20
READ_SIZE = 65536
CLONE_NEWPID = 0x20000000
PR_SET_KEEPCAPS, PR_CAPBSET_DROP = 8, 24
CAP_SYS_ADMIN = 21
CAPS_V3 = 0x20080522
READY = b"\0stockade-execd-ready\n"


def frame(rid, kind, payload=b""):
    return HEADER.pack(rid, kind[0], len(payload)) + payload


def unframe(buf):
    """The whole frames at the start of `buf` and the rest: ([(id, kind, payload)], rest);
    ValueError for a frame longer than MAX_FRAME."""
    out = []
    while len(buf) >= HEADER.size:
        rid, kind, n = HEADER.unpack_from(buf)
        if n > MAX_FRAME:
            raise ValueError(f"frame of {n} bytes")
        if len(buf) < HEADER.size + n:
            break
        out.append((rid, bytes([kind]), bytes(buf[HEADER.size:HEADER.size + n])))
        buf = buf[HEADER.size + n:]
    return out, buf


def status_of(code):
    """Popen's returncode as a shell's status (a signal N: 128+N)."""
    return 128 - code if code < 0 else code


class _Caps(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def become(libc, uid, gid):
    """Root with the four capabilities -> the sandbox's uid/gid, CAP_SYS_ADMIN only, an
    empty bounding set; raises OSError unless /proc/self/status shows exactly that."""
    def check(rc, what):
        if rc != 0:
            raise OSError(ctypes.get_errno(), what)
    check(libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "PR_SET_KEEPCAPS")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and cap < 41:
            raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(CAPS_V3, 0)
    data = (_Caps * 2)(_Caps(1 << CAP_SYS_ADMIN, 1 << CAP_SYS_ADMIN, 0), _Caps(0, 0, 0))
    check(libc.capset(header, data), "capset")
    with open("/proc/self/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    want = {"CapEff": 1 << CAP_SYS_ADMIN, "CapPrm": 1 << CAP_SYS_ADMIN, "CapBnd": 0}
    got = {k: int(status[k].strip(), 16) for k in want}
    uids, gids = set(status["Uid"].split()), set(status["Gid"].split())
    if got != want or uids != {str(uid)} or gids != {str(gid)} or os.getgroups():
        raise OSError(0, f"exec server identity is {got} {status['Uid']} {status['Gid']}")


class Exec:
    def __init__(self, rid, proc):
        self.rid, self.proc = rid, proc
        self.open = 2  # stdout and stderr not yet at EOF
        self.pending = b""  # stdin not yet written
        self.eof = False


class Server:
    def __init__(self, libc):
        self.libc = libc
        self.sel = selectors.DefaultSelector()
        self.execs = {}
        self.buf = b""
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(0, selectors.EVENT_READ, "host")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "chld")

    def send(self, rid, kind, payload=b""):
        data = frame(rid, kind, payload)
        while data:
            data = data[os.write(1, data):]

    def start(self, rid, req):
        if self.libc.unshare(CLONE_NEWPID) != 0:
            self.fail(rid, f"unshare: {os.strerror(ctypes.get_errno())}", 126)
            return
        try:
            proc = subprocess.Popen(  # the launcher's checked argv, no shell
                req["argv"], env=req["env"], cwd=req["cwd"], close_fds=True,
                stdin=subprocess.PIPE if req["stdin"] else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as e:
            self.fail(rid, f"stockade: {req['argv'][0]}: {e.strerror or e}",
                      127 if isinstance(e, FileNotFoundError) else 126)
            return
        ex = self.execs[rid] = Exec(rid, proc)
        for kind, pipe in ((b"O", proc.stdout), (b"R", proc.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self.sel.register(pipe, selectors.EVENT_READ, (ex, kind))
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
        self.send(rid, b"P", str(proc.pid).encode())

    def fail(self, rid, message, code):
        self.send(rid, b"P", b"0")
        self.send(rid, b"R", message.encode() + b"\n")
        self.send(rid, b"X", str(code).encode())

    def stdin(self, ex, data, eof):
        ex.pending += data
        ex.eof = ex.eof or eof
        self.flush_stdin(ex)

    def flush_stdin(self, ex):
        pipe = ex.proc.stdin
        if pipe is None or pipe.closed:
            return
        try:
            while ex.pending:
                ex.pending = ex.pending[os.write(pipe.fileno(), ex.pending):]
        except BlockingIOError:
            pass
        except OSError:  # the command closed its stdin: what is left is dropped
            ex.pending, ex.eof = b"", True
        registered = self._watched(pipe)
        if ex.pending and not registered:
            self.sel.register(pipe, selectors.EVENT_WRITE, (ex, b"I"))
        elif not ex.pending and registered:
            self.sel.unregister(pipe)
        if not ex.pending and ex.eof:
            pipe.close()

    def _watched(self, pipe):
        try:
            self.sel.get_key(pipe)
            return True
        except KeyError:
            return False

    def host(self):
        data = os.read(0, READ_SIZE)
        if not data:
            raise SystemExit(0)
        frames, self.buf = unframe(self.buf + data)
        for rid, kind, payload in frames:
            ex = self.execs.get(rid)
            if kind == b"S" and ex is None:
                self.start(rid, marshal.loads(payload))  # noqa: S302 - the launcher's
            elif kind in (b"I", b"E") and ex is not None:
                self.stdin(ex, payload, kind == b"E")
            elif kind == b"K" and ex is not None and ex.proc.returncode is None:
                # pid 1 of the exec's namespace: its end ends every process in it
                os.kill(ex.proc.pid, signal.SIGKILL)

    def output(self, ex, kind, pipe):
        if kind == b"I":
            self.flush_stdin(ex)
            return
        try:
            data = os.read(pipe.fileno(), READ_SIZE)
        except BlockingIOError:
            return
        if data:
            self.send(ex.rid, kind, data)
            return
        self.sel.unregister(pipe)
        pipe.close()
        ex.open -= 1
        self.reap()

    def reap(self):
        for rid, ex in list(self.execs.items()):
            if ex.proc.returncode is None:
                ex.proc.poll()
            if ex.proc.returncode is not None and ex.open == 0:
                if ex.proc.stdin is not None and not ex.proc.stdin.closed:
                    if self._watched(ex.proc.stdin):
                        self.sel.unregister(ex.proc.stdin)
                    ex.proc.stdin.close()
                del self.execs[rid]
                self.send(rid, b"X", str(status_of(ex.proc.returncode)).encode())

    def serve(self):
        os.write(1, READY)
        while True:
            for key, _ in self.sel.select():
                if key.data == "host":
                    self.host()
                elif key.data == "chld":
                    while True:
                        try:
                            os.read(self.wake_r, 512)
                        except BlockingIOError:
                            break
                    self.reap()
                else:
                    self.output(*key.data, key.fileobj)


def main():
    uid, gid = int(os.environ.pop("STOCKADE_UID")), int(os.environ.pop("STOCKADE_GID"))
    fcntl.fcntl(1, fcntl.F_SETFL, fcntl.fcntl(1, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    libc = ctypes.CDLL(None, use_errno=True)
    become(libc, uid, gid)
    Server(libc).serve()


if __name__ == "__main__":
    main()
