"""Snapshot starts for microVMs: one template guest per image and machine shape, booted and
saved once (QEMU migration into a file), and every later guest of that shape restored from
it instead of booting its kernel (most of a cold start under TCG).

The template boots with `stockade.template` on its command line: vm-images/init then stops
after the kernel, its modules and the lockdown sysctls, before any share is mounted (QEMU
cannot migrate a guest with a 9p share mounted) and before anything of a task exists,
says `stockade-template-ready` on its agent port and waits there. Its devices are the
shape's own (the same 9p tags, ports, NIC; the guest's drivers probed them), their host
ends an empty directory and /dev/null. A restored guest gets the same device list with its
sandbox's host ends and `-incoming fd:` of the saved state; the launcher then writes a line
on the agent port and the guest goes on: mounts its config share, and its init applies the
plan's fresh identity (MAC, entropy seed, clock: `microvm.fresh_identity`) before its
network or anything task-related exists.

The shape (`shape_key`): QEMU, accelerator, kernel, initramfs and image stamp, guest RAM,
vCPUs, the TCG cache, the share tags in device order, the hardening flags. A template is
`<state_dir>/microvm-snapshots/<key>.vmstate`, renamed into place whole; when and how often
one is built, and whether a file may be restored, is launcher/vmtemplates.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from . import microvm

SNAP_DIR = "microvm-snapshots"
TEMPLATE_MAC = "02:00:00:00:00:01"  # a restored guest takes its sandbox's (fresh_identity)
READY = b"stockade-template-ready\n"
GO = b"go\n"  # what a restored guest waits for on its agent port
SUFFIX = ".vmstate"


class SnapshotError(RuntimeError):
    pass


def _shares(v: microvm.VmSpec) -> list[microvm.Share]:
    # qemu_argv's device order
    return [microvm.Share(microvm.CFG_TAG, v.cfg_dir, "/sbx/cfg"), *v.layout.shares,
            *v.layout.input_shares]


def file_identity(path: str) -> list[int] | None:
    """What changes when a file is rebuilt or replaced (None: it does not exist)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def image_files(v: microvm.VmSpec) -> dict[str, list[int] | None]:
    """The QEMU binary, kernel, initramfs and firmware of `v`, each with its
    `file_identity` now."""
    return {f: file_identity(f) for f in (v.qemu, v.kernel, v.initrd, v.bios) if f}


def shape_key(v: microvm.VmSpec, stamp: str) -> str:
    """What a template must have in common with the guests restored from it: the machine,
    and the QEMU binary, kernel and initramfs files as they are now."""
    files = list(image_files(v).values())
    shape = [v.qemu, v.accel, v.kernel, v.initrd, files, stamp, v.memory_mib, v.cpus,
             v.tb_size_mib,
             [(s.tag, s.readonly) for s in _shares(v)], v.runas, v.seccomp,
             list(v.extra_cmdline)]
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:32]


def template_spec(v: microvm.VmSpec, empty_dir: str, agent_fd: int,
                  qmp_fd: int) -> microvm.VmSpec:
    """The template of `v`'s shape (pure): its devices, no host end of any sandbox."""
    blank = [dataclasses.replace(s, host=empty_dir) for s in v.layout.shares]
    inputs = [dataclasses.replace(s, host=empty_dir) for s in v.layout.input_shares]
    layout = dataclasses.replace(v.layout, shares=tuple(blank), input_shares=tuple(inputs))
    return dataclasses.replace(
        v, mac=TEMPLATE_MAC, cfg_dir=empty_dir, layout=layout, console="/dev/null",
        ports=("/dev/null", "/dev/null", "/dev/null"), agent_fd=agent_fd, template=True,
        qmp_fd=qmp_fd, incoming_fd=None)


def restore_spec(v: microvm.VmSpec, incoming_fd: int) -> microvm.VmSpec:
    """`v` restored from its shape's template (pure): `v` must have its agent port."""
    if v.agent_fd is None:
        raise ValueError("a restored guest needs its agent port")
    return dataclasses.replace(v, template=True, incoming_fd=incoming_fd)


def template_path(state_dir: Path, key: str) -> Path:
    return state_dir / SNAP_DIR / f"{key}{SUFFIX}"


class Qmp:
    """The few QMP commands a template save needs, over a connected socket."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock, self.buf = sock, b""
        sock.settimeout(timeout_s)
        self._read()  # the greeting
        self.cmd("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise SnapshotError("QEMU closed its monitor")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    def cmd(self, name: str, fds: list[int] | None = None, **args: Any) -> Any:
        msg = json.dumps({"execute": name, **({"arguments": args} if args else {})}).encode()
        if fds:
            socket.send_fds(self.sock, [msg], fds)
        else:
            self.sock.sendall(msg)
        while True:
            reply = self._read()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise SnapshotError(f"QEMU {name}: {reply['error'].get('desc', reply)}")


def await_running(sock: socket.socket, timeout_s: float) -> float:
    """Until a guest restored with `-incoming` runs (its QMP monitor on `sock`); seconds it
    took. SnapshotError when QEMU refused the state (it ends) or did not load it in time."""
    t0 = time.monotonic()
    qmp = Qmp(sock, timeout_s)
    while (status := qmp.cmd("query-status").get("status")) != "running":
        if status not in ("inmigrate", "prelaunch", "restore-vm"):
            raise SnapshotError(f"the restored guest is {status}")
        if time.monotonic() - t0 > timeout_s:
            raise SnapshotError("the restored guest did not run in time")
        time.sleep(0.005)
    return time.monotonic() - t0


def await_ready(sock: socket.socket, timeout_s: float, marker: bytes = READY) -> None:
    """Until the guest says `marker` on its agent port: a template boot stopped for its
    save (READY), a pooled guest waits for its plan (microvm.POOLED_READY)."""
    sock.settimeout(timeout_s)
    got = b""
    while marker not in got:
        chunk = sock.recv(4096)
        if not chunk:
            raise SnapshotError("the guest ended before it was ready")
        got = (got + chunk)[-4096:]
    sock.settimeout(None)


def _save(qmp: Qmp, out_fd: int, timeout_s: float) -> None:
    # no `stop` first: the saved run state would be "paused" and a restored guest would stay
    # paused; the guest sleeps in a read, so the migration converges at once (and then
    # stops the source itself)
    qmp.cmd("getfd", fds=[out_fd], fdname="vmstate")
    qmp.cmd("migrate", uri="fd:vmstate")
    end = time.monotonic() + timeout_s
    while (status := qmp.cmd("query-migrate").get("status")) not in ("completed", "failed",
                                                                       "cancelled"):
        if time.monotonic() > end:
            raise SnapshotError("the template's state was not saved in time")
        time.sleep(0.05)
    if status != "completed":
        raise SnapshotError(f"saving the template failed ({status})")


def save_template(v: microvm.VmSpec, dest: Path, timeout_s: float) -> None:
    """Boot `v`'s template, save its state into `dest` (whole or not at all)."""
    empty = dest.parent / f".{dest.stem}.empty"
    empty.mkdir(mode=0o755, exist_ok=True)
    agent, agent_q = socket.socketpair()
    qmp_s, qmp_q = socket.socketpair()
    t = template_spec(v, str(empty), agent_q.fileno(), qmp_q.fileno())
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    # QEMU in a network namespace of its own, on a tap nothing is connected to
    # (it dies with the thread that builds it: a launcher that exits leaves no template boot)
    argv = ["setpriv", "--pdeathsig", "KILL", "unshare", "--net", "--", "sh", "-c",
            "ip tuntap add tap0 mode tap && exec \"$@\"", "sh", *microvm.qemu_argv(t)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, pass_fds=(agent_q.fileno(), qmp_q.fileno()),
                            start_new_session=True, cwd="/")
    agent_q.close()
    qmp_q.close()
    try:
        await_ready(agent, timeout_s)
        out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _save(Qmp(qmp_s, timeout_s), out_fd, timeout_s)
            os.fsync(out_fd)
        finally:
            os.close(out_fd)
        os.replace(tmp, dest)
    except (OSError, ValueError, SnapshotError) as e:
        _stop(proc)
        err = proc.stderr.read().decode("utf-8", "replace").strip() if proc.stderr else ""
        raise SnapshotError(f"the template could not be saved: {e}"
                            + (f" (QEMU: {err[-300:]})" if err else "")) from None
    finally:
        _stop(proc)
        if proc.stderr is not None:
            proc.stderr.close()
        for s in (agent, qmp_s):
            s.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        with contextlib.suppress(OSError):
            empty.rmdir()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
