"""The files API's host side against a hostile sandbox that shares the scratch: what it
plants (a FIFO) and what it races (a mkdir beside ours). Pure: a temporary tree, as root."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
from stockade.launcher import files, mounts

SANDBOX = files.Owner(23456, 23457)  # not the test's own uid: ownership is observable


@pytest.fixture(autouse=True)
def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("chowning to the sandbox user needs root")


def _visible_dirs(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, _ in os.walk(root):
        out += [Path(dirpath) / d for d in dirnames if not d.startswith(files.TMP_PREFIX)]
    return out


@pytest.mark.parametrize("walk", [False, True])
def test_created_directories_are_never_visible_root_owned(
        scratch_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, walk: bool) -> None:
    """Every time the API chowns something, no directory a sandbox could see under its
    real name is still root's: a sandbox writer racing the upload never meets EACCES."""
    if walk:
        monkeypatch.setattr(files, "_openat2_works", False)
    root = scratch_tmpfs
    os.chown(root, SANDBOX.uid, SANDBOX.gid)
    seen: list[tuple[Path, int]] = []
    real_fchown = os.fchown

    def spy(fd: int, uid: int, gid: int) -> None:
        seen.extend((d, d.lstat().st_uid) for d in _visible_dirs(root))
        real_fchown(fd, uid, gid)

    monkeypatch.setattr(os, "fchown", spy)
    assert files.write(str(root), "a/b/c/f.txt", iter([b"data"]), 10, SANDBOX) == 4
    monkeypatch.undo()
    assert seen, "the spy saw no chown"
    assert [d for d, uid in seen if uid != SANDBOX.uid] == []
    for d in ("a", "a/b", "a/b/c"):
        st = (root / d).lstat()
        assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid) == (SANDBOX.uid,
                                                                          SANDBOX.gid)
    assert sorted(p.name for p in (root / "a").iterdir()) == ["b"]  # no temporary left


def test_a_racing_sandbox_mkdir_is_kept(scratch_tmpfs: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox makes the same directory between our lookup and our rename: its
    directory stays (not replaced by ours), the upload lands in it, nothing is left."""
    root = scratch_tmpfs
    real_mkdir = os.mkdir
    racer: list[int] = []

    def racing_mkdir(path: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(path, mode, dir_fd=dir_fd)
        if not racer:  # the sandbox's own mkdir of the real name, right after ours
            real_mkdir(root / "d", 0o700)
            os.chown(root / "d", SANDBOX.uid, SANDBOX.gid)
            racer.append((root / "d").lstat().st_ino)

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    assert files.write(str(root), "d/f", iter([b"x"]), 10, SANDBOX) == 1
    monkeypatch.undo()
    st = (root / "d").lstat()
    assert racer and st.st_ino == racer[0] and stat.S_IMODE(st.st_mode) == 0o700
    assert (root / "d" / "f").read_bytes() == b"x"
    assert sorted(p.name for p in root.iterdir()) == ["d"]


@pytest.mark.parametrize("walk", [False, True])
def test_a_planted_fifo_is_refused_not_waited_on(
        scratch_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, walk: bool) -> None:
    """A FIFO at the read's path used to block the API's open (a thread of the service
    per request, for ever, no writer ever coming): it is refused like a directory."""
    if walk:
        monkeypatch.setattr(files, "_openat2_works", False)
    root = scratch_tmpfs
    fifo = root / "pipe"
    os.mkfifo(fifo)
    result: list[BaseException | bytes] = []

    def read() -> None:
        try:
            result.append(files.read(str(root), "pipe", 10))
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # the open blocked: unblock it so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(30)
        pytest.fail("files.read blocked on a FIFO the sandbox planted")
    assert isinstance(result[0], files.FileError) and result[0].code == "path_refused"
    assert "not a regular file" in result[0].detail


def test_an_unmounted_scratch_is_refused(scratch_tmpfs: Path, tmp_path: Path) -> None:
    """A request that reaches files after the session's teardown unmounted its scratch
    (a PUT whose body arrived late): refused as session_ended, and nothing is written to
    the host's disk under the mount point; a scratch already removed is refused alike
    (it was an OSError, a 500)."""
    root = scratch_tmpfs
    assert files.write(str(root), "f", iter([b"x"]), 10, SANDBOX) == 1
    mounts.umount(str(root))  # as rootfs.remove_scratch does (lazily)
    me = files.Owner(os.getuid(), os.getgid())
    calls = [lambda: files.write(str(root), "d/g", iter([b"y"]), 10, me),
             lambda: files.read(str(root), "f", 10),
             lambda: files.listing(str(root), "")]
    for call in calls:
        with pytest.raises(files.FileError) as e:
            call()
        assert (e.value.code, e.value.status) == ("session_ended", 409)
    assert list(root.iterdir()) == []  # the host's directory under the mount: untouched
    root.rmdir()
    for call in calls:
        with pytest.raises(files.FileError) as e:
            call()
        assert e.value.code == "session_ended"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_huge_directory_is_not_read_past_the_cut(
        scratch_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing is cut at MAX_ENTRIES, and reading stops there: a sandbox's directory of
    millions of empty files cost a full readdir (and an lstat each) per request."""
    monkeypatch.setattr(files, "MAX_ENTRIES", 5)
    for i in range(50):
        (scratch_tmpfs / f"f{i:02}").touch()
    read: list[str] = []
    real = os.scandir

    class Counting:
        def __init__(self, fd: int) -> None:
            self.it = real(fd)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.it.close()

        def __iter__(self) -> Counting:
            return self

        def __next__(self) -> os.DirEntry[str]:
            entry = next(self.it)
            read.append(entry.name)
            return entry

    monkeypatch.setattr(os, "scandir", Counting)
    entries = files.listing(str(scratch_tmpfs), "")
    monkeypatch.undo()
    assert len(entries) == 5 and {e["type"] for e in entries} == {"file"}
    assert len(read) <= 6  # the five kept and at most the one that showed the cut
