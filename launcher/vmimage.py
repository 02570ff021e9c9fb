"""The microVM guest image (built by vm-images/build.sh) and the host's means to run it:
whether the backend is usable here, and which accelerator to use.

`accel: auto` boots the guest once with KVM (no network, no task: the guest's init finds
no config share and reboots at once) with a short timeout; KVM is used when that boot ends
in time, TCG otherwise (on some hosts /dev/kvm exists but guests hang). The answer is
cached in a file keyed by everything it depends on, so one probe serves every launcher
process until the kernel, image or QEMU changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import vmsnapshot
from .microvm import Accel, bios_argv

KERNEL = "vmlinux"
INITRD = "initramfs.cpio.gz"
MANIFEST = "manifest.json"
BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "vm-images" / "build.sh"


@dataclass(frozen=True, slots=True)
class Image:
    kernel: str
    initrd: str
    stamp: str


def load_image(image_dir: str) -> Image:
    """The built image, or ValueError saying what is missing. `image_dir` is resolved first
    (build.sh swaps a symlink): kernel, initramfs and stamp come from one build."""
    d = Path(image_dir).resolve()
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        raise ValueError(f"no microVM image in {image_dir} (build it with "
                         f"vm-images/build.sh {image_dir}; scripts/bootstrap.sh does)") from None
    for name in (KERNEL, INITRD):
        if not (d / name).is_file():
            raise ValueError(f"microVM image in {image_dir} lacks {name}")
    return Image(str(d / KERNEL), str(d / INITRD), str(manifest.get("stamp", "")))


def qemu_path(qemu: str) -> str | None:
    return shutil.which(qemu)


# qboot, the minimal firmware that jumps straight into the kernel's PVH entry: QEMU 7.2's
# microvm default (bios-microvm.bin, a link to it); Debian's QEMU 10 ships no
# bios-microvm.bin, so its microvm falls back to SeaBIOS, which cannot boot our kernel
# without the option ROMs the machine turns off ("No bootable device")
QBOOT_PATHS = ("/usr/share/qemu/qboot.rom", "/usr/share/qboot/bios.bin")


def microvm_bios() -> str | None:
    """The firmware to name with `-bios` (None: QEMU's default)."""
    return next((p for p in QBOOT_PATHS if os.path.isfile(p)), None)


_VERSION = re.compile(rb"QEMU emulator version (\d+)\.(\d+)")
RUN_WITH_SINCE = (8, 1)  # `-run-with user=`; QEMU 10.0 removed `-runas`


def parse_qemu_version(text: bytes) -> tuple[int, int] | None:
    """(major, minor) from `qemu -version`'s first line, None when it has none."""
    m = _VERSION.search(text[:512])
    return (int(m[1]), int(m[2])) if m else None


@functools.lru_cache(maxsize=8)
def _qemu_version(path: str, identity: tuple[int, ...]) -> tuple[int, int] | None:
    """Keyed by the binary's identity, so an upgraded QEMU is asked again."""
    try:
        proc = subprocess.run([path, "-version"], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_qemu_version(proc.stdout)


def run_with(qemu: str) -> bool:
    """Whether this QEMU binary drops privileges with `-run-with user=` (8.1 and later);
    an older or unknown one gets `-runas`, which it refuses with a clear error if wrong."""
    identity = vmsnapshot.file_identity(qemu)
    if identity is None:
        return False
    version = _qemu_version(qemu, tuple(identity))
    return version is not None and version >= RUN_WITH_SINCE


def host_problem(image_dir: str, qemu: str, init_python: str) -> str | None:
    """Why the microVM backend cannot run here (None: it can). Cheap: a few stat calls."""
    if qemu_path(qemu) is None:
        return f"QEMU ({qemu}) is not installed (scripts/bootstrap.sh installs qemu-system-x86)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (the guest's network is a tap device)"
    if not os.access(init_python, os.X_OK):
        return f"{init_python} is missing (the guest's init runs the host's Python)"
    try:
        load_image(image_dir)
    except ValueError as e:
        return str(e)
    return None


def tsc_khz() -> int | None:
    """The host's TSC rate in kHz (x86 /proc/cpuinfo "cpu MHz"), for TCG guests."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def probe_key(qemu: str, image: Image) -> str:
    return json.dumps([qemu_path(qemu), _mtime(qemu_path(qemu)), image.stamp,
                       os.uname().release, microvm_bios()])


def _mtime(path: str | None) -> float:
    try:
        return os.stat(path).st_mtime if path else 0.0
    except OSError:
        return 0.0


# a probe that timed out (a host busy enough to slow a KVM boot, or KVM guests that hang)
# is tried again after this long; a probe that failed outright is kept until the key changes
TIMEOUT_RETRY_S = 3600.0
Probe = Literal["ok", "failed", "timeout"]


def _cached(cache_file: Path, key: str) -> Accel | None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        cached = json.loads(cache_file.read_text())
        expires = cached.get("expires_at")
        if (cached.get("key") == key and cached.get("accel") in ("kvm", "tcg")
                and (expires is None or time.time() < expires)):
            return cached["accel"]  # type: ignore[no-any-return]
    return None


def resolve_accel(setting: str, qemu: str, image: Image, cache_file: Path,
                  timeout_s: float) -> Accel:
    """`kvm`/`tcg` as configured; `auto`: the cached probe's answer (probing when unknown).
    Concurrent first sandboxes (any launcher process) probe once: the probe runs under a
    flock of `<cache_file>.lock`, and whoever waited finds the answer cached."""
    if setting in ("kvm", "tcg"):
        return setting  # type: ignore[return-value]
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    key = probe_key(qemu, image)
    hit = _cached(cache_file, key)
    if hit is not None:
        return hit
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_file.with_name(cache_file.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        hit = _cached(cache_file, key)  # probed by another process while we waited
        if hit is not None:
            return hit
        result = probe_kvm(qemu, image, timeout_s)
        accel: Accel = "kvm" if result == "ok" else "tcg"
        now = time.time()
        entry = {"key": key, "accel": accel, "probed_at": now, "probe": result,
                 "expires_at": now + TIMEOUT_RETRY_S if result == "timeout" else None}
        with contextlib.suppress(OSError):
            fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=".accel.")
            with os.fdopen(fd, "w") as fh:
                json.dump(entry, fh)
            os.replace(tmp, cache_file)
    return accel


def probe_kvm(qemu: str, image: Image, timeout_s: float) -> Probe:
    """"ok" when a KVM guest boots to its init and ends within `timeout_s`, "timeout" when it
    does not end in time, "failed" otherwise."""
    argv = [qemu, "-M", "microvm", *bios_argv(microvm_bios()), "-nodefaults",
            "-no-user-config", "-nographic", "-no-reboot", "-accel", "kvm", "-cpu", "host",
            "-m", "128M", "-smp", "1",
            "-kernel", image.kernel, "-initrd", image.initrd,
            "-append", "console=ttyS0 quiet panic=-1 reboot=t", "-serial", "stdio"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return "timeout"
    except OSError:
        return "failed"
    # the init, finding no config share, says so on the console and reboots
    return "ok" if proc.returncode == 0 and b"stockade-vm-init" in proc.stdout else "failed"

