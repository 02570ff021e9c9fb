"""Files of a session over the control API: confined to its scratch whatever the sandbox
puts in the way (symlinks to host paths, `..`, a symlink swapped in while we work), size
limits that leave the old file as it was."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from . import sessions_rig
from .sessions_rig import Rig

pytestmark = pytest.mark.netns
rig, stier, session = sessions_rig.rig, sessions_rig.stier, sessions_rig.session


def _put(rig: Rig, sid: str, path: str, data: bytes) -> sessions_rig.Answer:
    return rig.api.call("PUT", f"/v1/sessions/{sid}/files?path={quote(path)}", raw=data,
                        headers={"Content-Type": "application/octet-stream"})


def _get(rig: Rig, sid: str, query: str) -> sessions_rig.Answer:
    return rig.api.call("GET", f"/v1/sessions/{sid}/files?{query}")


def test_write_read_list(rig: Rig, session: str) -> None:
    a = _put(rig, session, "src/app.py", b"print('hi')\n")
    assert a.status == 200 and a.json() == {"path": "src/app.py", "size": 12}
    r = rig.api.exec(session, ["sh", "-c", "python3 src/app.py; stat -c %u:%g src/app.py src; "
                               "echo out > src/result.txt"])
    assert r["stdout"] == "hi\n65534:65534\n65534:65534\n", r
    assert _get(rig, session, "path=src/result.txt").body == b"out\n"
    entries = _get(rig, session, "list=src").json()["entries"]
    assert entries == [{"name": "app.py", "type": "file", "size": 12},
                       {"name": "result.txt", "type": "file", "size": 4}]
    assert {"name": "src", "type": "dir", "size": 0} in _get(rig, session, "list=").json()[
        "entries"]
    # binary content round-trips byte for byte
    blob = bytes(range(256)) * 8
    _put(rig, session, "bin", blob)
    assert _get(rig, session, "path=bin").body == blob


@pytest.mark.parametrize("path", ["/etc/passwd", "../../etc/passwd", "a/../b", "./x", ""])
def test_paths_refused(rig: Rig, session: str, path: str) -> None:
    for a in (_put(rig, session, path, b"x"), _get(rig, session, f"path={quote(path)}")):
        assert a.status == 400 and a.json()["error"] == "path_refused", a.body


def test_symlinks_refused(rig: Rig, session: str, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "f").write_text("host")
    # inside the sandbox these name its own files; on the host they would name the host's
    rig.api.exec(session, ["sh", "-c", f"ln -s {canary} dirlink; ln -s {canary}/f filelink; "
                           "ln -s / rootlink"])
    for path in ("dirlink/f", "filelink", "rootlink/etc/hostname", "dirlink/new"):
        for a in (_put(rig, session, path, b"evil"), _get(rig, session, f"path={path}")):
            assert a.status == 400 and a.json()["error"] == "path_refused", (path, a.body)
    a = _get(rig, session, "list=dirlink")
    assert a.status == 400 and a.json()["error"] == "path_refused"
    assert (canary / "f").read_text() == "host" and sorted(p.name for p in canary.iterdir()) \
        == ["f"]
    kinds = {e["name"]: e["type"] for e in _get(rig, session, "list=").json()["entries"]}
    assert kinds["dirlink"] == kinds["filelink"] == "symlink"


def test_oversized_write_keeps_the_old_file(rig: Rig, session: str) -> None:
    _put(rig, session, "keep.txt", b"old")
    a = _put(rig, session, "keep.txt", b"x" * (16 * 2**20 + 1))  # the profile's disk: 16 MiB
    assert a.status == 413 and a.json()["error"] == "too_large"
    # over the free space of the scratch: the kernel refuses, nothing is lost either
    rig.api.exec(session, ["sh", "-c", "head -c 12000000 /dev/zero > fill"])
    a = _put(rig, session, "keep.txt", b"y" * 8 * 2**20)
    assert a.status == 413 and a.json()["error"] == "too_large", a.body
    assert _get(rig, session, "path=keep.txt").body == b"old"
    names = [e["name"] for e in _get(rig, session, "list=").json()["entries"]]
    assert not [n for n in names if n.startswith(".stockade-upload-")]


def test_not_found_and_not_a_file(rig: Rig, session: str) -> None:
    a = _get(rig, session, "path=nope")
    assert a.status == 404 and a.json()["error"] == "not_found"
    rig.api.exec(session, ["mkdir", "d"])
    a = _get(rig, session, "path=d")
    assert a.status == 400 and a.json()["error"] == "path_refused"


# Runs in the sandbox: swaps `d` between a directory and a symlink to a host directory
# for `seconds`, holding each about a millisecond; prints how many symlinks it placed.
# Renamed away, not `rm -rf`: our writes land in `d` whenever it is a directory, and on
# the gVisor and microVM tiers a shell loop (a process per step, ~0.1 s each) lost its
# `rm -rf d` to them (ENOTEMPTY), so `d` stayed the directory we wrote into and the race
# was never met; a rename takes a directory away whatever it holds.
SWAPPER = """
import os, shutil, sys, time
target, end = sys.argv[1], time.monotonic() + float(sys.argv[2])
n = k = 0
while time.monotonic() < end:
    k += 1  # a fresh name: a write of ours may still land in the last one
    try:
        # beside itself, not into another directory: a rename to another parent needs
        # write access to `d` itself (its `..`), which a `d` the host just made (root's
        # until its fchown) does not give
        os.rename("d", f"gone-{k}")
    except FileNotFoundError:
        pass
    except PermissionError:
        time.sleep(0.001)
        continue
    try:  # at once: under TCG the host's next write would make `d` again first
        os.symlink(target, "d")
    except FileExistsError:
        continue  # the host made `d` meanwhile: renamed away next round
    finally:
        shutil.rmtree(f"gone-{k}", ignore_errors=True)
    n += 1
    time.sleep(0.001)
    os.unlink("d")
    try:
        os.mkdir("d")
    except FileExistsError:
        pass
    time.sleep(0.001)
print(n)
"""


def test_racing_symlink_swap(rig: Rig, session: str, tmp_path: Path) -> None:
    """The sandbox swaps `d` between a directory and a symlink to a host directory as
    fast as it can while we write and read `d/x`: every answer is a write inside the
    scratch or a refusal, the host directory never sees a byte, and the race is met (a
    request found the symlink mid-walk) on every tier."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "x").write_text("host")
    done = threading.Event()
    swapped: dict[str, Any] = {}
    swapper = threading.Thread(target=lambda: (swapped.update(rig.api.exec(
        session, ["python3", "-c", SWAPPER, str(target), "6"])), done.set()))
    swapper.start()
    seen = set()
    try:
        while not done.is_set():
            for a in (_put(rig, session, "d/x", b"sandbox"), _get(rig, session, "path=d/x")):
                seen.add((a.status, a.json()["error"] if a.status >= 400 else "ok"))
                if a.status == 200 and a.headers.get("Content-Type", "").startswith(
                        "application/octet-stream"):
                    assert a.body == b"sandbox"
    finally:
        swapper.join(60)
    assert (target / "x").read_text() == "host" and [p.name for p in target.iterdir()] == ["x"]
    assert seen <= {(200, "ok"), (400, "path_refused"), (404, "not_found")}, seen
    # the race ran: the swapper placed its symlink again and again while we went on
    assert swapped.get("exit_code") == 0 and int(swapped["stdout"]) > 0, swapped
    assert (400, "path_refused") in seen, (seen, swapped)
