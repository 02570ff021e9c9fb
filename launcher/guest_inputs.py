"""A claimed pooled microVM guest's inputs (the guest side of `vminputs.py`), loaded by
guest_init.py from the pooled plan's modules: builtins only, no launcher import.

The plan's `claim_inputs` entries are written as root to a tmpfs of their size under
/sbx (root's alone, mode 0700), every entry root's with its mode less every write bit,
the tmpfs then remounted read-only; the returned input table binds each input's root at
its target, which guest_init.mount_inputs checks as a cold start's (reserved paths,
symlinks) and binds read-only. A target the guest already has (or an earlier input's, or
one under it) is refused first.
"""

import os

STAGE = "/sbx/claim-in"
INPUTS_READY = b"stockade-inputs-ready\n"  # vminputs.INPUTS_READY
_KINDS = ("dir", "file", "link", "fifo")


def write_tree(entries, root):
    """The entries (kind, relative path, mode, data) under `root`, parents first; nothing
    followed: each is made new (O_EXCL), and only names the launcher's walk produced."""
    for kind, rel, mode, data in entries:
        if kind not in _KINDS or rel.startswith("/") or ".." in rel.split("/"):
            raise OSError(f"bad input entry {rel!r}")
        path = f"{root}/{rel}"
        if kind == "dir":
            os.mkdir(path, 0o700)
        elif kind == "file":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        elif kind == "link":
            os.symlink(data, path)
        else:
            os.mkfifo(path, 0o600)
        os.lchown(path, 0, 0)
        if kind != "link":
            os.chmod(path, mode & 0o555)


def stage(claim, bb):
    """The inputs on their read-only tmpfs; the input table that binds them (`bb`: the
    init's busybox runner). OSError for a target that exists or a write that fails."""
    done = []
    for target in claim["targets"]:  # an earlier input's target or tree counts as there
        if os.path.lexists(target) or any(target == d or target.startswith(d + "/")
                                          for d in done):
            raise OSError(f"input target {target!r} already exists in the sandbox")
        done.append(target)
    bb("mount", "-o", "remount,rw", "/")
    try:
        os.mkdir(STAGE, 0o700)
    finally:
        bb("mount", "-o", "remount,ro", "/")
    bb("mount", "-t", "tmpfs", "-o", f"size={int(claim['size'])},mode=0700,nosuid,nodev",
       "stockade-inputs", STAGE)
    write_tree(claim["entries"], STAGE)
    bb("mount", "-o", "remount,ro,nosuid,nodev", STAGE)
    return "".join(f"bind {STAGE}/{i} {t}\n" for i, t in enumerate(claim["targets"]))
