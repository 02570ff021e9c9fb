"""A sandbox's filesystem on the host: the size-capped scratch tmpfs, the generated /etc
(with the inspection CA's trust bundle) and the read-only binds of host paths."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from . import initscript, mounts, trust

if TYPE_CHECKING:  # annotations only
    from .settings import LauncherSettings

HOST_ETC = "/etc"
FULL_BELOW = 64 * 1024  # free bytes under which a failing command counts as a disk limit


class Etc(NamedTuple):
    """What the sandbox's /etc is made of."""

    host_etc: bool  # the host's whole /etc (ro_binds lists it), nothing generated
    names: tuple[str, ...]  # the files written into the generated /etc directory
    trust_vars: dict[str, str]  # the trust bundle's environment ({} without inspection)


def host_bind(path: str, target: str) -> initscript.Bind | None:
    """A read-only bind of a host path; a symlink is copied as a symlink (`/bin -> usr/bin`,
    `/etc/localtime`); None when the host lacks it."""
    if os.path.islink(path):
        return initscript.Bind(path, target, symlink_to=os.readlink(path))
    if os.path.exists(path):
        return initscript.Bind(path, target, is_dir=os.path.isdir(path))
    return None


def system_binds(ro_binds: list[str]) -> list[initscript.Bind]:
    return [b for p in ro_binds if (b := host_bind(p, p)) is not None]


def host_etc(ro_binds: list[str]) -> bool:
    """`ro_binds` lists /etc itself: the host's whole /etc, as before the minimal one."""
    return any(os.path.normpath(p) == HOST_ETC for p in ro_binds)


def etc_binds(etc_allowlist: list[str]) -> list[initscript.Bind]:
    """The host /etc entries `etc_allowlist` names (globs expanded; absent ones skipped)."""
    out: dict[str, initscript.Bind] = {}
    for entry in etc_allowlist:
        for p in sorted(glob.glob(os.path.join(HOST_ETC, entry))):
            b = host_bind(p, p)
            if b is not None:
                out.setdefault(p, b)
    return list(out.values())


def prepare(base: Path, disk: int, host_ip: str, s: LauncherSettings, config: Any) -> Etc:
    """`base`/{root,scratch,etc}: the scratch tmpfs (out, tmp, home for the sandbox user)
    and the generated /etc files with the trust bundle."""
    root, scratch, etc = base / "root", base / "scratch", base / "etc"
    for d in (root, scratch, etc):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o711)  # noqa: S103 - traversable, not listable
    mounts.mount_tmpfs(str(scratch), disk, s.sandbox_uid, s.sandbox_gid)
    for sub in ("out", "tmp", "home"):
        (scratch / sub).mkdir()
        os.chown(scratch / sub, s.sandbox_uid, s.sandbox_gid)
    os.chmod(scratch / "tmp", 0o1777)  # noqa: S103 - sticky /tmp inside
    whole = host_etc(s.ro_binds)
    names = initscript.HOST_ETC_OVERLAY if whole else initscript.GENERATED_ETC
    content = initscript.etc_content(host_ip, "sandbox", s.sandbox_uid, s.sandbox_gid)
    for name in names:
        (etc / name).write_text(content[name])
        os.chmod(etc / name, 0o644)  # root's, readable: the bind is read-only too
    # the gateway's inspection CA, so clients verify inspected TLS flows; with the
    # host's whole /etc bound there is no generated /etc to put it in (docs/launcher.md)
    trusted = None if whole else trust.write_trust_bundle(config, etc)
    if trusted is None:
        return Etc(whole, tuple(names), {})
    return Etc(whole, (*names, trusted[0]), trusted[1])


def stage_guest_etc(etc: Path, binds: list[initscript.Bind], with_trust: bool) -> None:
    """A microVM guest's /etc is this directory: the allowlist copied in, the trust bundle
    over the system's default one (as the netns backend binds it)."""
    for b in binds:
        copy_into(b, etc / os.path.relpath(b.target, HOST_ETC))
    default = etc / trust.DEFAULT_BUNDLE
    if with_trust and default.is_file() and not default.is_symlink():
        tmp = default.with_name(f".{default.name}.stockade")
        shutil.copyfile(etc / trust.TRUST_BUNDLE_NAME, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, default)


def copy_into(b: initscript.Bind, dest: Path) -> None:
    """Copy one allowlisted host /etc entry into the guest's /etc directory (symlinks as
    symlinks: the guest resolves them against its own /usr, like the netns sandbox)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if b.symlink_to is not None:
        os.symlink(b.symlink_to, dest)
    elif b.is_dir:
        shutil.copytree(b.source, dest, symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(b.source, dest)
        os.chmod(dest, 0o644)


def remove_scratch(base: Path) -> None:
    scratch = base / "scratch"
    for _ in range(3):
        if not mounts.umount(str(scratch)):
            break
    shutil.rmtree(base, ignore_errors=True)


def scratch_full(scratch: str) -> bool:
    """The sandbox's scratch tmpfs (under `scratch`, its record's directory) is all but full."""
    try:
        st = os.statvfs(Path(scratch) / "scratch")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW
