"""A pooled microVM claim's inputs without a guest: the host's walk (`vminputs.pack`: what
it refuses, the caps) and the guest's writer (`guest_inputs.write_tree`, run here on a
host directory: the tree it makes from the walk's entries)."""

from __future__ import annotations

import marshal
import os
import socket
import stat
from pathlib import Path

import pytest
from stockade.launcher import guest_inputs, microvm, vminputs
from stockade.launcher.initscript import Bind


def _tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f.txt").write_text("deep\n")
    (tree / "sub" / "f.txt").chmod(0o666)
    (tree / "run.sh").write_text("#!/bin/sh\n")
    (tree / "run.sh").chmod(0o4755)  # set-uid: dropped
    (tree / "link").symlink_to("sub/f.txt")
    os.mkfifo(tree / "fifo")
    return tree


def test_a_tree_and_a_file_are_rebuilt_root_owned_without_write_bits(tmp_path: Path) -> None:
    tree, single = _tree(tmp_path), tmp_path / "one.txt"
    single.write_bytes(b"\x00one\xff")
    single.chmod(0o600)  # a file input: readable by all in the guest, as a cold start's
    claim = vminputs.pack([Bind(str(single), "/inputs/one.txt"),
                           Bind(str(tree), "/data/tree", is_dir=True)])
    assert claim["targets"] == ["/inputs/one.txt", "/data/tree"]
    plan = microvm.encode_plan({"claim_inputs": claim})
    blob = marshal.loads(plan)["claim_inputs"]  # noqa: S302 - the guest's own decoding
    out = tmp_path / "out"
    out.mkdir()
    guest_inputs.write_tree(blob["entries"], str(out))
    assert (out / "0").read_bytes() == b"\x00one\xff"
    assert (out / "1" / "sub" / "f.txt").read_text() == "deep\n"
    assert os.readlink(out / "1" / "link") == "sub/f.txt"
    assert stat.S_ISFIFO(os.lstat(out / "1" / "fifo").st_mode)
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(os.lstat(p).st_mode)
             for p in out.rglob("*") if not p.is_symlink()}
    assert modes["0"] == 0o444 and modes["1/sub/f.txt"] == 0o444 and modes["1/run.sh"] == 0o555
    assert not any(m & 0o222 for m in modes.values()), modes
    assert {(os.lstat(p).st_uid, os.lstat(p).st_gid) for p in out.rglob("*")} == {(0, 0)}
    assert claim["size"] >= len(b"\x00one\xff") + len("deep\n") + len("#!/bin/sh\n")


def test_a_socket_or_a_device_in_an_input_is_refused_by_name(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tree / "sub" / "sock"))
        with pytest.raises(vminputs.InputRefused, match=r"input /data/tree/sub/sock is a "
                                                        "device or a socket"):
            vminputs.pack([Bind(str(tree), "/data/tree", is_dir=True)])
    with pytest.raises(vminputs.InputRefused, match=r"input /inputs/null is a device"):
        vminputs.pack([Bind("/dev/null", "/inputs/null")])


def test_the_check_refuses_what_pack_refuses_without_reading(tmp_path: Path) -> None:
    tree, big = _tree(tmp_path), tmp_path / "big"
    big.write_bytes(b"x" * 1000)
    vminputs.check([Bind(str(tree), "/data/tree", is_dir=True), Bind(str(big), "/i/big")])
    with pytest.raises(vminputs.InputRefused, match="over 999 bytes"):
        vminputs.check([Bind(str(big), "/inputs/big")], cap=999)
    with pytest.raises(vminputs.InputRefused, match="over 3 files"):
        vminputs.check([Bind(str(tree), "/data/tree", is_dir=True)], max_entries=3)
    with pytest.raises(vminputs.InputRefused, match="/inputs/null is a device"):
        vminputs.check([Bind("/dev/null", "/inputs/null")])


def test_the_caps_refuse_before_reading_past_them(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 1000)
    assert len(vminputs.pack([Bind(str(big), "/inputs/big")], cap=1000)["entries"]) == 1
    with pytest.raises(vminputs.InputRefused, match="over 999 bytes"):
        vminputs.pack([Bind(str(big), "/inputs/big")], cap=999)
    tree = _tree(tmp_path)
    with pytest.raises(vminputs.InputRefused, match="over 3 files and directories"):
        vminputs.pack([Bind(str(tree), "/data/tree", is_dir=True)], max_entries=3)


def test_a_target_that_is_not_a_clean_path_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ValueError, match="absolute and normalised"):
        vminputs.pack([Bind(str(f), "/inputs/a\nbind /x /y")])


@pytest.mark.parametrize("entry", [("dir", "../up", 0o755, b""), ("dev", "0", 0o644, b""),
                                   ("file", "/abs", 0o644, b"")])
def test_the_guest_writes_only_names_a_walk_makes(tmp_path: Path,
                                                  entry: tuple[str, str, int, bytes]) -> None:
    with pytest.raises(OSError, match="bad input entry"):
        guest_inputs.write_tree([entry], str(tmp_path))
    assert not list(tmp_path.iterdir())
