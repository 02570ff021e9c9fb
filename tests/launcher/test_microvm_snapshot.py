"""Snapshot starts with real QEMU (TCG): a template saved once per machine shape, later
guests restored from it with a fresh identity (address, MAC, entropy, clock), one-shot and
session alike. The image is built from this tree's vm-images/ into the test's own directory
(the template's stop lives in its init)."""

from __future__ import annotations

import json
import subprocess
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from stockade.launcher import SandboxSpec, vmimage, vmsnapshot
from stockade.launcher.backends import backend_for
from stockade.policy.model import Limits, Profile

from .conftest import Lab
from .test_launcher_leak import EMPTY, leftovers
from .test_microvm_session import run, started_session

pytestmark = [pytest.mark.netns, pytest.mark.slow]

WHO = r"""
import json, os, socket, subprocess, time
addr = subprocess.run(["ip", "-o", "-4", "addr", "show", "eth0"], capture_output=True,
                      text=True).stdout.split()
link = subprocess.run(["ip", "-o", "link", "show", "eth0"], capture_output=True,
                      text=True).stdout.split("link/ether ")[1].split()[0]
print(json.dumps({"random": os.urandom(16).hex(), "addr": addr[3].split("/")[0], "mac": link,
                  "cmdline": open("/proc/cmdline").read(), "clock": time.time()}))
"""


@pytest.fixture(scope="module")
def snap_lab(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    image = tmp_path_factory.mktemp("vmimage") / "vm"
    subprocess.run(["bash", str(vmimage.BUILD_SCRIPT), str(image)], check=True,
                   capture_output=True, timeout=600)
    strict = lab.launcher.s
    lab.launcher.s = strict.model_copy(update={"microvm": strict.microvm.model_copy(
        update={"image_dir": str(image)})})
    try:
        yield lab
    finally:
        lab.launcher.s = strict


# a TTL that outlasts a cold boot on a loaded host (the lab's "vm" profile has 30 s)
RULES = types.SimpleNamespace(version="lab-1", profiles={"vms": Profile(
    "vms", "snapshot starts", isolation="microvm", selftest="sampled",  # as the lab's
    limits=Limits(cpus=1.0, memory=64 * 2**20, disk=8 * 2**20, pids=64, ttl=300))})


def _who(lab: Lab) -> tuple[dict[str, object], str]:
    res = lab.launcher.run(SandboxSpec("vms", ["python3", "-c", WHO]), RULES)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout), res.task_id


def test_restored_guests_get_a_fresh_identity(snap_lab: Lab) -> None:
    lab = snap_lab
    backend = backend_for("microvm")
    state = Path(lab.config.state_dir) / "launcher"
    backend.missed.clear()  # type: ignore[attr-defined] # only this image's shape
    cold, _ = _who(lab)
    assert "stockade.template" not in str(cold["cmdline"])  # booted
    assert backend.build_templates(state)  # type: ignore[attr-defined]
    assert list((state / vmsnapshot.SNAP_DIR).glob(f"*{vmsnapshot.SUFFIX}"))
    with ThreadPoolExecutor(2) as pool:  # at once: two slots, two addresses
        guests = list(pool.map(lambda _: _who(lab), range(2)))
    for out, tid in guests:
        assert "stockade.template" in str(out["cmdline"])  # restored, not booted
        start = lab.events(tid)[0]
        rec_ip = start["source"]["ip"]
        assert out["addr"] == rec_ip  # its own address
        assert abs(float(out["clock"]) - time.time()) < 120  # type: ignore[arg-type]
    (a, _), (b, _) = guests
    # different random bytes, addresses and MACs: nothing of the template's identity stays
    assert a["random"] != b["random"] != cold["random"]
    assert a["addr"] != b["addr"] and a["mac"] != b["mac"]
    assert a["mac"] != vmsnapshot.TEMPLATE_MAC
    # a session restored from the same template serves its execs
    with started_session(lab, RULES, "vms") as (live, _):
        assert live.pipes.restored
        rc, out, err = run(live, ["python3", "-c", WHO])
        assert rc == 0, err
        me = json.loads(out)
        assert me["addr"] == live.record.guest_ip and me["random"] != a["random"]
    assert leftovers(lab) == EMPTY
