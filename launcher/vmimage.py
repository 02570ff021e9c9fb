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
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .microvm import Accel

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
                       os.uname().release])


def _mtime(path: str | None) -> float:
    try:
        return os.stat(path).st_mtime if path else 0.0
    except OSError:
        return 0.0


def resolve_accel(setting: str, qemu: str, image: Image, cache_file: Path,
                  timeout_s: float) -> Accel:
    """`kvm`/`tcg` as configured; `auto`: the cached probe's answer (probing when unknown)."""
    if setting in ("kvm", "tcg"):
        return setting  # type: ignore[return-value]
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    key = probe_key(qemu, image)
    with contextlib.suppress(OSError, ValueError):
        cached = json.loads(cache_file.read_text())
        if cached.get("key") == key and cached.get("accel") in ("kvm", "tcg"):
            return cached["accel"]  # type: ignore[no-any-return]
    accel: Accel = "kvm" if probe_kvm(qemu, image, timeout_s) else "tcg"
    with contextlib.suppress(OSError):
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=".accel.")
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "accel": accel, "probed_at": time.time()}, fh)
        os.replace(tmp, cache_file)
    return accel


def probe_kvm(qemu: str, image: Image, timeout_s: float) -> bool:
    """True when a KVM guest boots to its init and ends within `timeout_s`."""
    argv = [qemu, "-M", "microvm", "-nodefaults", "-no-user-config", "-nographic",
            "-no-reboot", "-accel", "kvm", "-cpu", "host", "-m", "128M", "-smp", "1",
            "-kernel", image.kernel, "-initrd", image.initrd,
            "-append", "console=ttyS0 quiet panic=-1 reboot=t", "-serial", "stdio"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s, check=False)
    except (subprocess.TimeoutExpired, OSError):
        return False
    # the init, finding no config share, says so on the console and reboots
    return proc.returncode == 0 and b"stockade-vm-init" in proc.stdout

