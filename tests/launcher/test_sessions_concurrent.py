"""Many sessions at once on the container tier (the issue's 100 concurrent sessions, as
bench/session_bench.py --concurrent 100 shows them; here 20): all created at once, one
exec in each at once, each in a sandbox of its own (network namespace, scratch), all
killed at once, and nothing left on the host (namespaces, links, nft set elements,
cgroups, scratch, mounts, the launcher's state)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
from polling import eventually

from . import sessions_rig
from .sessions_rig import Rig, host_leftovers

rig = sessions_rig.rig

pytestmark = pytest.mark.netns

N = 20
NOTHING = {"netns": [], "links": [], "elements": {}, "cgroups": [], "scratch": [],
           "mounts": []}


def _left(rig: Rig) -> dict[str, Any]:
    return {**host_leftovers(rig.config.launcher), "state": rig.svc.launcher.list()}


@pytest.mark.timeout(900)
def test_sessions_at_once_are_isolated_and_leave_nothing(rig: Rig) -> None:
    with concurrent.futures.ThreadPoolExecutor(N) as pool:
        sids = list(pool.map(lambda _: rig.api.create("svc")["session_id"], range(N)))
        assert len(set(sids)) == N

        def run(sid: str) -> tuple[str, str]:
            r = rig.api.exec(sid, ["sh", "-c", f"readlink /proc/self/ns/net; echo {sid} > mine;"
                                               " ls"])
            assert r["exit_code"] == 0, r
            net, *files = r["stdout"].split()
            return net, " ".join(files)

        answers = list(pool.map(run, sids))
        # each exec saw its own namespace and a scratch holding its own file and no other
        # session's (home, out, tmp: every scratch's layout)
        assert len({net for net, _ in answers}) == N, answers
        assert {files for _, files in answers} == {"home mine out tmp"}
        assert [rig.api.exec(sid, ["cat", "mine"])["stdout"] for sid in sids] == \
            [f"{sid}\n" for sid in sids]
        list(pool.map(rig.api.kill, sids))
    assert eventually(lambda: _left(rig) == {**NOTHING, "state": []}, 120), _left(rig)
    for sid in sids:
        assert rig.api.call("GET", f"/v1/sessions/{sid}").json()["state"] == "ended"
