"""The snapshot templates' cache without QEMU: keys follow the image files, a template file
is restored only when it is whole (sidecar, size, QEMU's header, digest), a broken one is
removed with the reason. (Saving and restoring: test_microvm_snapshot.py, real QEMU.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from stockade.launcher import vmsnapshot, vmtemplates

from .test_launcher_microvm_pure import _spec


def _image(tmp: Path) -> tuple[str, str]:
    k, i = tmp / "vmlinux", tmp / "initramfs.cpio.gz"
    k.write_bytes(b"kernel")
    i.write_bytes(b"initramfs")
    return str(k), str(i)


def test_the_key_follows_the_kernel_and_initramfs_files(tmp_path: Path) -> None:
    kernel, initrd = _image(tmp_path)
    v = _spec(kernel=kernel, initrd=initrd)
    key = vmsnapshot.shape_key(v, "stamp")
    assert vmsnapshot.shape_key(_spec(kernel=kernel, initrd=initrd), "stamp") == key
    # a rebuilt image under the same paths (and the same stamp) is another template
    Path(initrd).write_bytes(b"initramfs, rebuilt")
    assert vmsnapshot.shape_key(v, "stamp") != key
    key2 = vmsnapshot.shape_key(v, "stamp")
    os.replace(kernel, tmp_path / "old")
    Path(kernel).write_bytes(b"kernel")  # same bytes, a new file
    assert vmsnapshot.shape_key(v, "stamp") != key2


def _template(state: Path, key: str, body: bytes, meta: dict[str, object] | None) -> Path:
    p = vmsnapshot.template_path(state, key)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(body)
    if meta is not None:
        vmtemplates.meta_path(p).write_text(json.dumps(meta))
    return p


def _whole(body: bytes, p: Path) -> dict[str, object]:
    return {"size": len(body), "sha256": vmtemplates.digest(p), "key": p.stem}


def test_a_whole_template_is_found_a_broken_one_removed(tmp_path: Path) -> None:
    t = vmtemplates.Templates()
    assert t.lookup(tmp_path, "k0") is None  # none yet
    body = vmtemplates.MAGIC + b"state" * 100
    good = _template(tmp_path, "k1", body, None)
    vmtemplates.meta_path(good).write_text(json.dumps(_whole(body, good)))
    assert t.lookup(tmp_path, "k1") == good
    assert t.lookup(tmp_path, "k1") == good  # verified once, found again
    cases = {
        "k2": (body, None, "sidecar is missing"),
        "k3": (body[:-7], {"size": len(body), "sha256": "0"}, f"sidecar says {len(body)}"),
        "k4": (b"XXXX" + body[4:], "whole", "not a QEMU migration stream"),
        "k5": (body, {"size": len(body), "sha256": "0" * 64}, "SHA-256 differs"),
    }
    for key, (data, meta, why) in cases.items():
        p = _template(tmp_path, key, data, None)
        if meta is not None:
            m = _whole(data, p) if meta == "whole" else meta
            vmtemplates.meta_path(p).write_text(json.dumps(m))
        with pytest.raises(vmtemplates.Bad, match=why):
            t.lookup(tmp_path, key)
        assert not p.exists() and not vmtemplates.meta_path(p).exists(), key
        assert t.lookup(tmp_path, key) is None  # gone: the next start builds it anew
    assert good.exists()


def test_a_template_changed_after_its_check_is_checked_again(tmp_path: Path) -> None:
    t = vmtemplates.Templates()
    body = vmtemplates.MAGIC + b"a" * 64
    p = _template(tmp_path, "k", body, None)
    vmtemplates.meta_path(p).write_text(json.dumps(_whole(body, p)))
    assert t.lookup(tmp_path, "k") == p
    p.write_bytes(vmtemplates.MAGIC + b"b" * 64)  # same size, another file state
    os.utime(p, ns=(1, 1))
    with pytest.raises(vmtemplates.Bad, match="SHA-256"):
        t.lookup(tmp_path, "k")


def test_a_build_removes_the_templates_its_files_superseded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, initrd = _image(tmp_path)
    qemu = tmp_path / "qemu"
    qemu.write_bytes(b"qemu")
    state = tmp_path / "state"
    body = vmtemplates.MAGIC + b"state" * 10

    def save(shape: object, dest: Path, timeout_s: float) -> None:
        dest.write_bytes(body)

    monkeypatch.setattr(vmsnapshot, "save_template", save)
    t = vmtemplates.Templates()
    v = _spec(qemu=str(qemu), kernel=kernel, initrd=initrd)
    small = _spec(qemu=str(qemu), kernel=kernel, initrd=initrd, memory_mib=64)
    first, other = t.build_now(v, "s", state), t.build_now(small, "s", state)
    # an older launcher's sidecar names no files: kept, it cannot be judged
    legacy = _template(state, "legacy", body, None)
    vmtemplates.meta_path(legacy).write_text(json.dumps(_whole(body, legacy)))
    assert t.build_now(v, "s", state) == first and first.exists() and other.exists()

    Path(initrd).write_bytes(b"initramfs, rebuilt")  # both keys superseded
    assert sorted(vmtemplates.superseded(first.parent)) == sorted([first, other])
    rebuilt = t.build_now(v, "s", state)
    assert rebuilt != first and t.lookup(state, rebuilt.stem) == rebuilt
    for gone in (first, other):
        assert not gone.exists() and not vmtemplates.meta_path(gone).exists()
    assert legacy.exists() and vmtemplates.superseded(first.parent) == []

    qemu.unlink()  # QEMU removed (or upgraded): its templates can never be restored
    assert vmtemplates.superseded(first.parent) == [rebuilt]
