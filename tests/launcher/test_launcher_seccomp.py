"""The container tier's seccomp filter, in real sandboxes: every call it denies is refused
with EPERM (clone3 with ENOSYS), new namespaces cannot be made, and ordinary work (fork,
multiprocessing, pip, git, a C compiler) still runs. A profile that relaxes ptrace can
trace its child; the default profile cannot.

The probes call each denied system call with arguments the kernel would refuse with
another errno (EBADF, EFAULT, EINVAL) or accept (unshare(CLONE_NEWUSER), keyctl, clone3),
so an EPERM there is the filter's answer.
"""

from __future__ import annotations

import json
import sys

import pytest
from stockade.launcher import Launcher, LauncherError, seccomp_bpf
from stockade.launcher.seccomp_rules import CLONE_NEW_FLAGS, denied_names

from .conftest import Lab
from .test_launcher_leak import EMPTY, leftovers

pytestmark = pytest.mark.netns

PROBE = r"""
import ctypes, errno, json, os, sys
import seccomp  # Debian's python3-seccomp: only its syscall table is used here
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def nr(name):
    return seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr(name), *[ctypes.c_long(a) for a in args])
    if r == 0 and name == "clone":
        os._exit(0)  # the child of an unfiltered clone: never run on
    if r > 0 and name == "clone":
        os.waitpid(r, 0)
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
names = json.loads(sys.argv[1])
out = {n: call(n, -1, -1, -1, -1, -1, -1) for n in names if nr(n) >= 0}
for flag, value in json.loads(sys.argv[2]).items():
    out["clone " + flag] = call("clone", value | 17, 0, 0, 0, 0)  # 17: SIGCHLD
out["clone3"] = call("clone3", 0, 0)
out["unshare NEWUSER"] = call("unshare", 0x10000000)
out["personality ADDR_NO_RANDOMIZE"] = call("personality", 0x0040000)
out["personality query"] = call("personality", 0xFFFFFFFF)
out["personality PER_LINUX"] = call("personality", 0)
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
with open("/proc/self/status") as fh:
    out["status"] = [l.split()[1] for l in fh if l.startswith(("Seccomp:", "NoNewPrivs:"))]
print(json.dumps(out))
"""


def test_denied_calls_fail_with_eperm(lab: Lab) -> None:
    names = [n for n in denied_names() if n not in ("vhangup",)]
    res = lab.run(["python3", "-c", PROBE, json.dumps(names), json.dumps(CLONE_NEW_FLAGS)])
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out.pop("status") == ["1", "2"]  # NoNewPrivs: 1, Seccomp: 2 (filter mode)
    assert out.pop("clone3") == "ENOSYS"  # glibc falls back to clone, whose flags are seen
    assert out.pop("fork") == 7
    assert out.pop("personality query") == "ok"
    assert out.pop("personality PER_LINUX") == "ok"
    assert len(out) > 60  # every name that exists on this architecture was probed
    assert {k: v for k, v in out.items() if v != "EPERM"} == {}


NUMBERS_PROBE = r"""
import ctypes, errno, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
for nr in json.loads(sys.argv[1]):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(-1)] * 6)
    out[nr] = "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
print(json.dumps(out))
"""


def test_calls_newer_than_the_review_fail_with_enosys(lab: Lab) -> None:
    # on this host's kernel (6.18) 457-469 exist: unfiltered, -1 arguments give EINVAL,
    # EBADF or EFAULT; open_tree_attr (467) is a mount call and denied; numbers past the
    # last reviewed one are ENOSYS whether or not the kernel has them
    nums = [457, 458, 463, 467, 468, 469, 470, 471, 500, 1000]
    res = lab.run(["python3", "-c", NUMBERS_PROBE, json.dumps(nums)])
    assert res.exit_code == 0, res.stderr
    out = {int(k): v for k, v in json.loads(res.stdout).items()}
    assert out[467] == "EPERM"
    assert {n: out[n] for n in (470, 471, 500, 1000)} == dict.fromkeys((470, 471, 500, 1000),
                                                                       "ENOSYS")
    assert not {n: v for n, v in out.items() if n < 467 or n in (468, 469)
                if v in ("EPERM", "ENOSYS")}, out

def test_vhangup_refused(lab: Lab) -> None:
    # vhangup takes no argument: probed alone, it would hang up the sandbox's own stdio
    code = ("import ctypes, errno, seccomp\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "r = libc.syscall(seccomp.resolve_syscall(seccomp.Arch.NATIVE, 'vhangup'))\n"
            "print(r, errno.errorcode[ctypes.get_errno()])")
    res = lab.py(code)
    assert res.stdout.split() == ["-1", "EPERM"], res.stderr


def test_no_new_namespaces_from_tools(lab: Lab) -> None:
    res = lab.run(["sh", "-c", "unshare -Urn true; echo rc=$?; unshare -m true; echo rc=$?"])
    assert "rc=0" not in res.stdout, res.stdout
    assert res.stderr.count("Operation not permitted") == 2, res.stderr


def test_ptrace_only_where_the_profile_relaxes_it(lab: Lab) -> None:
    argv = ["strace", "-f", "-o", "/dev/null", "true"]
    denied = lab.run(argv)
    assert denied.exit_code != 0 and "Operation not permitted" in denied.stderr
    relaxed = lab.run(argv, profile="debug")
    assert relaxed.exit_code == 0, relaxed.stderr
    # the relaxation is ptrace alone: the rest of the filter is still there
    res = lab.run(["unshare", "-Ur", "true"], profile="debug")
    assert res.exit_code != 0 and "Operation not permitted" in res.stderr


WORK = r"""
set -e
cd /scratch
cat > hello.c <<'C'
#include <stdio.h>
int main(void) { puts("hello from c"); return 0; }
C
gcc -O1 -o hello hello.c && ./hello
git init -q repo && cd repo && git config user.email t@t && git config user.name t
echo x > f && git add f && git commit -qm one && git log --oneline | wc -l && cd ..
python3 - <<'PY'
import zipfile
with zipfile.ZipFile("sbxdemo-1.0-py3-none-any.whl", "w") as z:
    z.writestr("sbxdemo/__init__.py", "VALUE = 42\n")
    z.writestr("sbxdemo-1.0.dist-info/METADATA",
               "Metadata-Version: 2.1\nName: sbxdemo\nVersion: 1.0\n")
    z.writestr("sbxdemo-1.0.dist-info/WHEEL",
               "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr("sbxdemo-1.0.dist-info/RECORD", "")
PY
python3 -m pip install -q --no-index --disable-pip-version-check --target site \
    sbxdemo-1.0-py3-none-any.whl
PYTHONPATH=site python3 -c "import sbxdemo; print('pip', sbxdemo.VALUE)"
cat > test_mp.py <<'PY'
import concurrent.futures, multiprocessing, subprocess, unittest
def sq(x):
    return x * x
class T(unittest.TestCase):
    def test_pool(self):
        with multiprocessing.get_context("fork").Pool(4) as p:
            self.assertEqual(p.map(sq, range(50)), [x * x for x in range(50)])
    def test_spawn_pool(self):
        with concurrent.futures.ProcessPoolExecutor(3) as ex:
            self.assertEqual(sum(ex.map(sq, range(10))), 285)
    def test_subprocess(self):
        self.assertEqual(subprocess.run(["echo", "sub"], capture_output=True,
                                        text=True).stdout, "sub\n")
PY
python3 -m unittest -q test_mp 2>&1 | tail -1
"""


def test_ordinary_work_still_runs(lab: Lab) -> None:
    res = lab.run(["sh", "-c", WORK])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert res.stdout.split("\n")[:3] == ["hello from c", "1", "pip 42"], res.stdout
    assert res.stdout.rstrip().endswith("OK"), res.stdout


@pytest.mark.slow
def test_the_microvm_guest_applies_the_same_filter(lab: Lab) -> None:
    names = ["keyctl", "add_key", "bpf", "io_uring_setup", "userfaultfd", "ptrace", "mount",
             "setns", "perf_event_open", "open_by_handle_at"]
    res = lab.run(["python3", "-c", PROBE, json.dumps(names),
                   json.dumps({"CLONE_NEWUSER": CLONE_NEW_FLAGS["CLONE_NEWUSER"]})],
                  profile="vm")
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out.pop("status") == ["1", "2"]
    assert (out.pop("clone3"), out.pop("fork")) == ("ENOSYS", 7)
    assert (out.pop("personality query"), out.pop("personality PER_LINUX")) == ("ok", "ok")
    # without the filter the guest kernel answers ENOSPC (max_user_namespaces=0), EINVAL...
    assert out == dict.fromkeys([*names, "clone CLONE_NEWUSER", "unshare NEWUSER",
                                 "personality ADDR_NO_RANDOMIZE"], "EPERM")


ABI_PROBE = r"""
#include <stdio.h>
int main(void) {
    long r32, rx32;
    /* unshare(CLONE_NEWUSER) through the i386 ABI (int 0x80, nr 310) */
    __asm__ volatile("int $0x80" : "=a"(r32) : "a"(310L), "b"(0x10000000L) : "memory");
    /* and through x32 (syscall with __X32_SYSCALL_BIT, nr 272) */
    __asm__ volatile("syscall" : "=a"(rx32) : "a"(0x40000000L | 272L), "D"(0x10000000L)
                     : "rcx", "r11", "memory");
    printf("%ld %ld\n", r32, rx32);
    return 0;
}
"""


def test_compat_abis_are_filtered_too(lab: Lab) -> None:
    # unfiltered, the i386 call makes the namespace (0) and x32 is ENOSYS (-38) here
    script = "cd /scratch && cat > abi.c && gcc -o abi abi.c && ./abi"
    res = lab.run(["sh", "-c", script], stdin=ABI_PROBE.encode())
    assert res.exit_code == 0, res.stderr
    assert res.stdout.split() == ["-1", "-1"]  # -EPERM through both


def test_no_filter_no_sandbox(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    # an interpreter without libseccomp's binding (this venv's): the run is refused, clearly
    monkeypatch.setattr(Launcher, "_init_python", lambda self: sys.executable)
    with pytest.raises(LauncherError, match="install python3-seccomp"):
        lab.run(["true"])
    assert leftovers(lab) == EMPTY


def test_the_init_refuses_a_plan_without_a_filter(lab: Lab,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seccomp_bpf, "filter_for", lambda python, profile: b"")
    res = lab.run(["sh", "-c", "echo ran"])
    assert (res.exit_code, res.stdout) == (126, "")
    assert "the plan carries no seccomp filter" in res.stderr
