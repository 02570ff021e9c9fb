"""The gVisor tier's pure parts: runsc's platform choice, the global flags every runsc
subcommand gets, the host cgroup limits, and the OCI bundle (root layout + config.json)
built from the same `initscript.InitPlan` the container tier's init performs, so the
filesystem discipline stays one decision. The I/O shell is backends/gvisor.py.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import cgroups, initscript
from .spec import TASK_ID_RE

if TYPE_CHECKING:  # annotations only
    from .settings import GvisorSettings

MIB = 2**20
PLATFORMS = ("systrap", "ptrace", "kvm")
NETWORKS = ("sandbox", "host", "none")
# `runsc flags`: "specifies which platform to use: systrap (default), ptrace, kvm. (...)"
_PLATFORM_LINE = re.compile(r"platform to use:\s*([^.\n]*)")
RO_BIND = ["rbind", "ro", "nosuid", "nodev"]
RW_BIND = ["rbind", "rw", "nosuid", "nodev"]
CAP_SETS = ("bounding", "effective", "inheritable", "permitted", "ambient")


def platforms(flags_text: str) -> set[str]:
    """The platforms an installed runsc offers, from `runsc flags` (20221219 lacks systrap)."""
    m = _PLATFORM_LINE.search(flags_text)
    if m is None:
        return set()
    names = (w.split("(")[0].strip() for w in m.group(1).split(","))
    return {n for n in names if n in PLATFORMS}


def platform_choice(setting: str, offered: set[str], kvm_ok: bool) -> str:
    """The platform to run under; ValueError names why none fits. `auto` never picks kvm
    (it hangs on hosts whose KVM guests crash): only an explicit kvm with a working probe."""
    if setting == "auto":
        for p in ("systrap", "ptrace"):
            if p in offered:
                return p
        raise ValueError(f"runsc offers neither systrap nor ptrace (it lists "
                         f"{', '.join(sorted(offered)) or 'no platform'})")
    if setting not in offered:
        raise ValueError(f"the installed runsc has no {setting} platform (set "
                         "launcher.gvisor.platform to auto)")
    if setting == "kvm" and not kvm_ok:
        raise ValueError("runsc --platform=kvm did not run a probe command (set "
                         "launcher.gvisor.platform to auto)")
    return setting


def global_flags(runsc: str, state_root: str, platform: str, network: str,
                 debug_dir: str | None = None) -> list[str]:
    """runsc and its global flags, identical for every subcommand: runsc re-reads them per
    call, and another --root or --platform does not find (or mis-handles) the container."""
    if platform not in PLATFORMS or network not in NETWORKS:
        raise ValueError(f"unknown runsc platform/network {platform}/{network}")
    argv = [runsc, f"--root={state_root}", f"--platform={platform}", f"--network={network}",
            # the root is read-only: no overlay filestore in the bundle
            "--overlay2=none", "--host-uds=none", "--file-access=shared"]
    if debug_dir:
        argv += [f"--debug-log={debug_dir.rstrip('/')}/", "--debug"]
    return argv


def host_limits(limits: Any, s: GvisorSettings) -> cgroups.Limits:
    """The host cgroup's limits: it holds the Sentry, the gofer and (systrap) one stub per
    guest process besides the command; the profile's pids are the guest's NPROC."""
    return cgroups.Limits(memory=limits.memory + s.memory_overhead_mib * MIB,
                          pids=2 * limits.pids + s.pids_overhead, cpus=limits.cpus)


@dataclass
class RootLayout:
    """The bundle's read-only root directory (mount points, copied symlinks) and its mounts
    in order. Paths in dirs/files/symlinks are guest paths."""

    dirs: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    symlinks: list[tuple[str, str]] = field(default_factory=list)  # (guest path, link text)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    # (guest path, host file): single files of /etc copied into the read-only root, mode
    # and owner kept. Each bind is a mount the gofer and the Sentry set up per start
    # (~0.7 ms of CPU each, 20 of them in /etc); a copy in a read-only root shows the
    # sandbox the same bytes, read-only, and no other host path.
    copies: list[tuple[str, str]] = field(default_factory=list)

    def bind(self, b: initscript.Bind, target: str, options: list[str] = RO_BIND) -> None:
        if b.symlink_to is not None:
            self.symlinks.append((target, b.symlink_to))
            return
        (self.dirs if b.is_dir else self.files).append(target)
        self.mounts.append(_mount(target, b.source, options))


def _mount(dst: str, src: str, options: list[str]) -> dict[str, Any]:
    return {"destination": dst, "type": "bind", "source": src, "options": list(options)}


def _etc(layout: RootLayout, plan: initscript.InitPlan) -> None:
    """/etc as the container tier's init makes it (initscript._etc): generated files bound
    from etc_dir, allowlisted host entries, the trust bundle over its default."""
    if plan.host_etc:  # the host's whole /etc is a system bind: only the overlay files
        for name in plan.etc_files:
            layout.mounts.append(_mount(f"/etc/{name}", f"{plan.etc_dir}/{name}", RO_BIND))
        return
    layout.dirs.append("/etc")
    generated = {"/etc/" + n for n in plan.etc_files}
    for name in plan.etc_files:
        layout.copies.append((f"/etc/{name}", f"{plan.etc_dir}/{name}"))
    dir_binds = [d for b in plan.etc if (d := _etc_entry(layout, b, generated))]
    for name, rel in plan.etc_over:
        t = initscript._guest("/etc/" + rel)
        # only inside a directory the allowlist bound (a read-only bind cannot grow a file)
        if any(t.startswith(d + "/") for d in dir_binds):
            layout.mounts.append(_mount(t, f"{plan.etc_dir}/{name}", RO_BIND))


def _etc_entry(layout: RootLayout, b: initscript.Bind, generated: set[str]) -> str | None:
    """One allowlisted /etc entry into the layout (a single file copied, a directory bound,
    a symlink copied; none over a generated file); the guest path of a directory bind."""
    t = initscript._guest(b.target)
    if not t.startswith("/etc/"):
        raise ValueError(f"etc entry outside /etc: {b.target!r}")
    if any(t == g or t.startswith(g + "/") for g in generated):
        return None
    if b.symlink_to is None and not b.is_dir:
        layout.copies.append((t, b.source))
        return None
    layout.bind(b, t)
    return t if b.symlink_to is None else None


def root_layout(plan: initscript.InitPlan, reserved_extra: tuple[str, ...] = ()) -> RootLayout:
    """The gVisor bundle's root from the container tier's plan: every host path arrives as
    a bind mount of what the plan names (system dirs, /etc entries, scratch, inputs), no
    other. ValueError for an input at a reserved path."""
    layout = RootLayout(dirs=["/proc", "/dev"])
    layout.mounts += [
        {"destination": "/proc", "type": "proc", "source": "proc",
         "options": ["nosuid", "noexec", "nodev"]},
        # gVisor fills /dev itself (null, zero, full, random, urandom, tty, ptmx, pts):
        # every device is emulated by the Sentry, none is the host's
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "noexec", "strictatime", "mode=755", "size=64k"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",  # noqa: S108 - guest path
         "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={plan.shm_size}"]},
    ]
    for b in plan.system:
        layout.bind(b, initscript._guest(b.target))
    _etc(layout, plan)
    layout.dirs += [initscript.SCRATCH, initscript.TMP]
    layout.mounts += [_mount(initscript.SCRATCH, plan.scratch, RW_BIND),
                      _mount(initscript.TMP, plan.scratch + initscript.TMP, RW_BIND)]
    for b in plan.inputs:
        layout.bind(b, initscript.check_input_target(b.target, extra=reserved_extra))
    return layout


def oci_config(layout: RootLayout, root: str, argv: list[str], env: dict[str, str],
               plan: initscript.InitPlan, nproc: int, cgroups_path: str) -> dict[str, Any]:
    """config.json. The launcher owns the cgroups (no `linux.resources`: runsc joins the
    dirs at `cgroups_path` and sizes the Sentry from their memory limit). No seccomp entry:
    the Sentry is the syscall surface and runs under its own filter."""
    rlimits = [*plan.rlimits, ("NPROC", nproc)]
    return {
        "ociVersion": "1.0.2",
        "hostname": plan.hostname,
        "root": {"path": root, "readonly": True},
        "process": {
            "terminal": False,
            "user": {"uid": plan.uid, "gid": plan.gid, "additionalGids": []},
            "args": list(argv),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": initscript.SCRATCH,
            "capabilities": {k: [] for k in CAP_SETS},
            "rlimits": [{"type": f"RLIMIT_{n}", "hard": v, "soft": v} for n, v in rlimits],
            "noNewPrivileges": True,
        },
        "mounts": layout.mounts,
        "linux": {
            # no network namespace entry: the sandbox uses the netns runsc starts in
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
            "cgroupsPath": cgroups_path,
            "maskedPaths": [], "readonlyPaths": [],
        },
    }


# what the session's exec server starts with (gvisor_execd.become drops to the sandbox's
# uid keeping only CAP_SYS_ADMIN, for the per-exec pid namespace)
EXECD_CAPS = ["CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"]


def execd_process(first: dict[str, Any], python: str, source: str,
                  path: str) -> dict[str, Any]:
    """The OCI process of a session's exec server (`runsc exec --process`) from the
    container's first process: its rlimits and no_new_privs, root with EXECD_CAPS, the
    server's source as `python -I -S -c`, the uid/gid it drops to in its environment."""
    user = first["user"]
    return {
        "user": {"uid": 0, "gid": 0, "additionalGids": []},
        "args": [python, "-I", "-S", "-c", source],
        "env": [f"PATH={path}", f"STOCKADE_UID={user['uid']}", f"STOCKADE_GID={user['gid']}"],
        "cwd": "/",
        "capabilities": {k: ([] if k in ("inheritable", "ambient") else list(EXECD_CAPS))
                         for k in CAP_SETS},
        "rlimits": list(first.get("rlimits", [])),
        "noNewPrivileges": True,
    }


# The sandbox's CPU limit, written by an OCI prestart hook. runsc's start is CPU-bound and
# runs in the sandbox's cgroup, so the cgroup is made without a quota and this hook puts it
# in force: runsc (20240729) runs prestart hooks on the host once the Sentry and the gofer
# are up, before the root container's first process exists, and a hook that fails (or
# outlives its timeout) fails the start (OCI runtime spec): the command never runs without
# its limit. The value is read back, not trusted to have landed.
CPU_HOOK_SCRIPT = ('got=; printf %s "$2" > "$1" && { read -r got || :; } < "$1" && '
                   '[ "$got" = "$2" ] || '
                   '{ echo "stockade: the CPU limit $2 did not land in $1" >&2; exit 1; }')
HOOK_TIMEOUT_S = 10
HOOK_ENV = ["PATH=/usr/bin:/bin"]


def cpu_limit_hooks(limit_file: str, value: str, shell: str = "/bin/sh") -> dict[str, Any]:
    """config.json's `hooks`: the prestart hook that writes `value` to `limit_file` (a
    cgroup's cpu.cfs_quota_us or cpu.max) and fails the start unless it reads it back."""
    return {"prestart": [{"path": shell, "args": ["sh", "-c", CPU_HOOK_SCRIPT,
                                                  "stockade-cpu-limit", limit_file, value],
                          "env": list(HOOK_ENV), "timeout": HOOK_TIMEOUT_S}]}


# The start gate (backends/gvisor.py launch): runsc is started before the launcher has
# added the sandbox's nft set elements, registered it and proven its fence, so that its
# Sentry boots meanwhile; this hook, first of the prestart hooks, holds the command until
# the launcher writes "go" into the FIFO `$1`. Anything else, an EOF (the launcher closed
# it, or died) or the timeout fails runsc's start: the command never runs unfenced.
GATE_HOOK_SCRIPT = ('go=; { read -r go || :; } < "$1"; [ "$go" = go ] || '
                    '{ echo "stockade: the sandbox\'s start was not released" >&2; exit 1; }')
GATE_TIMEOUT_S = 120  # past the fence self-test's own timeouts under load


def start_gate_hook(fifo: str, shell: str = "/bin/sh") -> dict[str, Any]:
    """The prestart hook that waits for the launcher's "go" on `fifo` (GATE_HOOK_SCRIPT)."""
    return {"path": shell, "args": ["sh", "-c", GATE_HOOK_SCRIPT, "stockade-start-gate", fifo],
            "env": list(HOOK_ENV), "timeout": GATE_TIMEOUT_S}


def hook_probe_config(stamp: str, shell: str = "/bin/sh") -> dict[str, Any]:
    """probe_config with a prestart hook that creates `stamp`: the installed runsc runs
    prestart hooks (else the CPU limit is put in force when the cgroup is made)."""
    config = probe_config()
    config["hooks"] = {"prestart": [{"path": shell, "args": ["sh", "-c", ': > "$1"',
                                                             "stockade-hook-probe", stamp],
                                     "env": list(HOOK_ENV), "timeout": HOOK_TIMEOUT_S}]}
    return config


def probe_config() -> dict[str, Any]:
    """config.json of the runtime probes: /bin/true on the host's root, read-only, as
    nobody with no capabilities (the probe's only use is its exit status)."""
    return {"ociVersion": "1.0.2", "root": {"path": "/", "readonly": True},
            "process": {"user": {"uid": initscript.NOBODY, "gid": initscript.NOGROUP},
                        "args": ["/bin/true"], "env": ["PATH=/usr/bin:/bin"], "cwd": "/",
                        "capabilities": {k: [] for k in CAP_SETS}, "noNewPrivileges": True},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}]}}


def parse_list(stdout: str) -> list[str]:
    """Container ids of `runsc list -format=json` (`null` when there are none)."""
    data = json.loads(stdout or "null")
    if data is None:
        return []
    if not isinstance(data, list):
        raise ValueError("runsc list: not a JSON list")
    return [str(c["id"]) for c in data if isinstance(c, dict) and "id" in c]


def reconcile_ids(ids: list[str], keep: set[str]) -> list[str]:
    """The containers of this launcher's naming no record keeps."""
    return sorted(i for i in ids if TASK_ID_RE.match(i) and i not in keep)


_STATE_FILE = re.compile(r"(?:runsc-)?([0-9a-f]{10})[_.]")


def stale_state_files(names: list[str], keep: set[str]) -> list[str]:
    """Files in runsc's state root of containers no record keeps (`<id>_sandbox:<id>.lock`,
    `.state`, `runsc-<id>.sock`: what a runsc killed while starting leaves)."""
    out = []
    for n in names:
        m = _STATE_FILE.match(n)
        if m is not None and TASK_ID_RE.match(m.group(1)) and m.group(1) not in keep:
            out.append(n)
    return sorted(out)


def state_left(names: list[str], task_id: str) -> bool:
    """Whether runsc's state root (`names`) still holds state of `task_id` beyond its
    `.lock`: a `runsc run` that returned removes its own, also when its sandbox was
    killed; a run killed or crashed while starting leaves `.state` and the socket."""
    for n in names:
        m = _STATE_FILE.match(n)
        if m is not None and m.group(1) == task_id and not n.endswith(".lock"):
            return True
    return False


def stats_pids(stdout: str) -> int | None:
    """The Sentry's task count from `runsc events --stats` (None when it says nothing)."""
    try:
        n = json.loads(stdout)["data"]["pids"]["current"]
    except (ValueError, KeyError, TypeError):
        return None
    return n if isinstance(n, int) else None


def confined(root: str, guest: str) -> str:
    """The host path of a guest path under the bundle's root; ValueError when a symlink
    already made there would lead it outside."""
    p = os.path.join(root, guest.lstrip("/"))
    real = os.path.realpath(os.path.dirname(p))
    if real != os.path.realpath(root) and not real.startswith(os.path.realpath(root) + "/"):
        raise ValueError(f"mount point {guest!r} would be outside the sandbox root")
    return p
