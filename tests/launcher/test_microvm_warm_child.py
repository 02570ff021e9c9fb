"""A session microVM's child forked ahead (`guest_init.exec_child`) against the sandbox's own
code: a process exec 1 leaves running (the sandbox user, in the task's cgroup) tries, for
a few seconds, every other process of its uid outside the task's cgroup (the child waiting
for exec 2) through /proc/<pid>: its memory (read-write: code of the attacker's run
outside the cgroup), and fds 0-3: the next exec's stdin (read), stdout and stderr (write a
marker) and its control pipe (a forged request in `guest_agent.hand`'s format). All are
refused: the waiting child is not dumpable (the uid change made it so, fs.suid_dumpable
being 0, and `guest_init.become` says it again), so /proc/<pid>/mem and the fd links fail
the kernel's ptrace check, and the pipes are root's (0600), made by the agent. Made
dumpable on purpose, the child's memory opens read-write: this test fails. One TCG boot.
"""

from __future__ import annotations

import json
import time

import pytest

from .conftest import Lab
from .test_microvm_session import PATH, run, session_rules, started_session

pytestmark = [pytest.mark.netns, pytest.mark.slow]

MARKER = "STOCKADE-WARM-CHILD-MARKER"
# the attacker, as the sandbox user: a fd of the waiting child opened while that child is
# still outside the task's cgroup (not yet an exec: processes only ever move into it) is
# kept, written into (stdout, stderr, stdin: the marker; the control pipe: a request in
# guest_agent.hand's format) and read (stdin) until the end; the report comes last
ATTACKER = r"""
import errno, json, marshal, os, sys, time
MARKER = sys.argv[1]
forged = marshal.dumps({"argv": ["/bin/sh", "-c", "cat /proc/self/cgroup > "
                        "/scratch/forged.$$; echo " + MARKER + "; sleep 3", MARKER],
                        "env": {"PATH": "/usr/bin:/bin"}, "cwd": "/scratch"}, 4)
forged = len(forged).to_bytes(4, "big") + forged
me, uid = os.getpid(), os.getuid()
rep = {"errors": {}, "opened": [], "read": [], "forged_outside": [], "candidates": {},
       "suid_dumpable": open("/proc/sys/fs/suid_dumpable").read().strip(),
       "proc_mount": [l for l in open("/proc/mounts") if l.split()[2] == "proc"]}
kept = []

def field(pid, name):
    try:
        return open(f"/proc/{pid}/{name}", "rb").read().decode(errors="replace")
    except OSError:
        return None

def outside(pid):
    cg = field(pid, "cgroup")
    return cg is not None and cg.strip() != "0::/task"

def attack(pid):
    try:  # its memory, writable: any code of the attacker's in it (no syscall: no filter)
        fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        key = f"mem:rw:{errno.errorcode.get(e.errno, e.errno)}"
        rep["errors"][key] = rep["errors"].get(key, 0) + 1
    else:
        if outside(pid) and [pid, "mem", "rw"] not in rep["opened"]:
            rep["opened"].append([pid, "mem", "rw"])
        os.close(fd)
    for n in (0, 1, 2, 3):
        for mode, name in ((os.O_WRONLY, "w"), (os.O_RDONLY, "r")):
            try:
                fd = os.open(f"/proc/{pid}/fd/{n}", mode | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                key = f"fd{n}:{name}:{errno.errorcode.get(e.errno, e.errno)}"
                rep["errors"][key] = rep["errors"].get(key, 0) + 1
                continue
            if not outside(pid):  # an exec's own process by now: the task's, not ahead
                os.close(fd)
                continue
            rep["opened"].append([pid, n, name])
            kept.append((fd, n, name))
            if name == "w":
                try:
                    os.write(fd, forged if n == 3 else (MARKER + "\n").encode())
                except OSError as e:
                    rep["opened"].append(["write", errno.errorcode.get(e.errno)])

deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me:
            continue
        st = field(p, "status") or ""
        uids = [l.split()[1] for l in st.splitlines() if l.startswith("Uid:")]
        if uids != [str(uid)] or not outside(p):
            continue
        cmd = (field(p, "cmdline") or "").replace("\0", " ")
        if MARKER in cmd:
            rep["forged_outside"].append([p, cmd, field(p, "cgroup")])
        if p not in rep["candidates"]:
            try:
                fdst = os.stat(f"/proc/{p}/fd")
            except OSError:
                continue
            rep["candidates"][p] = {"cmdline": cmd[:200], "fd_dir_uid": fdst.st_uid,
                                    "fd_dir_mode": oct(fdst.st_mode & 0o777)}
        attack(p)
    for fd, n, name in kept:
        if name == "r":
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            if data:
                rep["read"].append([n, data.decode(errors="replace")])
    time.sleep(0.05)
with open("/scratch/attack.tmp", "w") as fh:
    json.dump(rep, fh)
os.rename("/scratch/attack.tmp", "/scratch/attack.json")
"""
# an exec that waits for the attacker's report, then shows it and what a forged command left
REPORT = ("while [ ! -e /scratch/attack.json ]; do sleep 0.2; done; cat /scratch/attack.json;"
          " echo; cat /scratch/forged.* 2>/dev/null; true")


def test_the_child_forked_ahead_is_out_of_the_sandbox_users_reach(lab: Lab) -> None:
    with started_session(lab, session_rules(lab), "vms") as (live, _):
        assert run(live, ["sh", "-c", "cat > /scratch/attack.py"],
                   stdin=ATTACKER.encode()) == (0, "", "")
        # exec 1 leaves the attacker running (its own output on a file: exec 1 ends at once)
        rc, out, err = run(live, ["sh", "-c", f"python3 /scratch/attack.py {MARKER} 8 "
                                  "</dev/null >/scratch/attack.out 2>&1 & echo started"])
        assert (rc, out) == (0, "started\n"), err
        time.sleep(3)  # the agent has forked exec 2's child ahead: the attacker tries it
        exec2 = run(live, ["cat"], stdin=b"legit\n")
        assert exec2 == (0, "legit\n", ""), exec2
        rc, out, err = run(live, ["sh", "-c", REPORT], env={"PATH": PATH})
        assert rc == 0 and MARKER not in out + err, (out, err)
        rep = json.loads(out.splitlines()[0])
        print(json.dumps(rep, indent=1))  # the evidence, with -s
        # the attacker did see a waiting child (the sandbox's uid, outside the task's cgroup)
        assert rep["candidates"], rep
        assert rep["opened"] == rep["read"] == rep["forged_outside"] == [], rep
        assert rep["suid_dumpable"] == "0", rep  # a uid change leaves a process non-dumpable
        # every try was refused by the kernel's ptrace check (or met a child already gone)
        assert {k.rsplit(":", 1)[1] for k in rep["errors"]} <= {"EACCES", "EPERM", "ENOENT"}
        assert any(k.endswith(("EACCES", "EPERM")) for k in rep["errors"]), rep
